"""ZMQ addresses: a registry's checked where it comes in and named in the hint when a registry does not
answer; any socket's bind or connect refused by ZMQ reported as a ``ConfigError`` (``attach``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import zmq

from refitflow.core.errors import ConfigError

__all__ = ["SCHEMES", "attach", "check_address", "check_addresses", "no_answer_hint"]

SCHEMES = ("tcp", "ipc", "inproc")
_ADDRESS = re.compile(r"^(?P<scheme>[a-z]+)://(?P<rest>.+)$")
_TCP = re.compile(r"^(?P<host>.+):(?P<port>\d{1,5}|\*)$")


def check_address(address: object) -> str:
    """``address`` if it is a ZMQ endpoint with a scheme refitflow speaks (and a port, for tcp), else a
    ``ConfigError`` saying why. What only ZMQ knows (a host it cannot parse, an ipc path too long) is
    refused where the socket binds or connects (``attach``)."""
    if not isinstance(address, str):
        raise ConfigError(f"a registry address is a string such as 'tcp://127.0.0.1:7100', got {address!r}")
    found = _ADDRESS.match(address)
    if found is None:
        guess = f"; did you mean 'tcp://{address}'?" if re.fullmatch(r"[\w.\-*]+:\d+|[\w.\-]+:\*", address) else ""
        raise ConfigError(f"registry address {address!r} has no scheme (tcp://host:port or ipc://path){guess}")
    if found["scheme"] not in SCHEMES:
        raise ConfigError(f"registry address {address!r}: scheme {found['scheme']!r} is not one of {SCHEMES}")
    if found["scheme"] == "tcp":
        tcp = _TCP.match(found["rest"])
        if tcp is None or (tcp["port"] != "*" and not 0 < int(tcp["port"]) < 65536):
            raise ConfigError(f"registry address {address!r} needs a port from 1 to 65535: tcp://host:port, "
                              f"e.g. 'tcp://127.0.0.1:7100' (or port * to bind any free one)")  # fmt: skip
    return address


def check_addresses(spec: object) -> list[str]:
    """The replicas of one registry: ``"tcp://h1:7100,tcp://h2:7100"`` (or a list), each checked."""
    if isinstance(spec, list | tuple):
        found = [check_address(a) for a in spec]
    elif isinstance(spec, str):
        found = [check_address(a.strip()) for a in spec.split(",") if a.strip()]
    else:
        found = [check_address(spec)]
    if not found:
        raise ConfigError(f"no registry address in {spec!r}")
    return found


def no_answer_hint(address: str, *, curve: bool) -> str:
    """What to check when the registry at ``address`` did not answer."""
    keys = (
        "this client uses CURVE: its public key must be in the registry's authorized folder and "
        "server_public_file must be the registry's server.key"
        if curve
        else "if the registry uses CURVE (its default), this client needs "
        "security=rf.DeploymentKeys(<folder>, role=...).client"
    )
    return f"is a registry serving there (refitflow registry --bind {address}) and reachable from here? {keys}"


def attach(bind_or_connect: Callable[[str], Any], address: str, what: str) -> None:
    """``bind_or_connect(address)`` (a socket's method); an address ZMQ refuses (malformed, taken) is a
    ``ConfigError`` that reads "{what} at {address}: {why}". The caller still owns the socket: it must
    close it, or its context's ``term()`` waits for it forever."""
    try:
        bind_or_connect(address)
    except zmq.ZMQError as exc:
        raise ConfigError(f"{what} at {address!r}: {exc}") from exc

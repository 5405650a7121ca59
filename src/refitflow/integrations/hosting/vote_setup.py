"""The engine vote's channel for an engine's workers (vLLM, SGLang): which vote, and its ZMQ addresses.

``plan`` turns the init info's ``vote`` (``auto``, ``none``, ``zmq``, ``gloo``) and ``vote_addresses`` into
what ``RankSession`` needs; with ``zmq`` and no addresses given, each worker binds a free port on
``vote_host`` and the addresses are exchanged over the engine's own torch.distributed group (a collective:
every worker of the engine must call it). ``gloo_group`` makes a gloo group of the vote's own, so a failed
vote cannot break the engine's groups.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from refitflow.core.errors import ConfigError

__all__ = ["exchange", "free_port", "gloo_group", "plan"]


def plan(vote: str, addresses: list[str] | None, host: str, size: int,
         group: Callable[[], Any]) -> tuple[str, tuple[str, ...]]:  # fmt: skip
    """The vote (``none``/``zmq``/``gloo``) and, for ``zmq``, one address per worker in rank order (exchanged
    over ``group()`` when not given)."""
    chosen = vote if vote != "auto" else ("zmq" if size > 1 else "none")
    if chosen != "zmq":
        return chosen, ()
    if addresses is not None:
        if len(addresses) != size:
            raise ConfigError(f"vote_addresses names {len(addresses)} workers, the engine has {size}")
        return chosen, tuple(addresses)
    return chosen, tuple(exchange(f"tcp://{host}:{free_port(host)}", size, group()))


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def exchange(mine: str, size: int, group: Any) -> list[str]:
    """Every worker's ``mine``, in rank order, over ``group`` (None: torch.distributed's default group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("the engine vote needs vote_addresses: there is no torch.distributed group to exchange them")
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    if len(out) != size:
        raise ConfigError(f"the worker group has {len(out)} ranks, the engine vote expects {size}")
    return [str(a) for a in out]


def gloo_group() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("the gloo vote needs a torch.distributed group")
    return dist.new_group(backend="gloo")

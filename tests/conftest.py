"""Shared fixtures: a tiny trainer/server pair, an embedded registry, and failure-injecting observers.

The device path: ``--device`` (or ``REFITFLOW_TEST_DEVICE``; default ``cpu``) chooses the device of the
tests that take the ``device`` fixture, so the same tests run on CPU here and on CUDA where one is
visible (``--device cuda``). Tests marked ``cuda`` need a GPU: where none is visible they are
deselected, and the header and the summary say which and why (never a silent skip).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import socket
from collections.abc import Callable

import pytest
import torch

import refitflow as rf
from refitflow.metrics import NullObserver
from tests._keys import drop_session_keys

NO_GPU = "no CUDA device is visible"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=os.environ.get("REFITFLOW_TEST_DEVICE", "cpu"),
        help="device of the device-path tests: cpu (default) or cuda / cuda:N",
    )


def pytest_configure(config: pytest.Config) -> None:
    device = torch.device(config.getoption("--device"))
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device must be cpu or cuda[:N], got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device} asked for, but {NO_GPU}")
    config.stash[_DESELECTED] = []


_DESELECTED = pytest.StashKey[list[str]]()


def pytest_unconfigure(config: pytest.Config) -> None:
    drop_session_keys()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    gone = [item for item in items if item.get_closest_marker("cuda") is not None]
    if gone:
        items[:] = [item for item in items if item.get_closest_marker("cuda") is None]
        config.hook.pytest_deselected(items=gone)
        config.stash[_DESELECTED].extend(item.nodeid for item in gone)


def pytest_report_header(config: pytest.Config) -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"none ({NO_GPU})"
    return f"refitflow device path: {config.getoption('--device')}; GPU: {gpu}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    gone = config.stash.get(_DESELECTED, [])
    if gone:
        terminalreporter.write_line(
            f"{len(gone)} CUDA-only test(s) deselected because {NO_GPU} (run them with --device cuda on a GPU):"
        )
        for nodeid in gone:
            terminalreporter.write_line(f"  deselected (needs CUDA): {nodeid}")


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device of the device-path tests (``--device``), with its index (``cuda`` is ``cuda:<current>``)."""
    device = torch.device(request.config.getoption("--device"))
    return torch.device("cuda", torch.cuda.current_device()) if device == torch.device("cuda") else device


class InjectedFailure(RuntimeError):
    """Raised by ``FailAt`` inside a stage (a real failure path, not a mock)."""


class FailAt(NullObserver):
    """An Observer that raises when ``stage`` finishes its ``after``-th item."""

    def __init__(self, stage: str, after: int = 1, action: Callable[[], None] | None = None) -> None:
        self.stage, self.after, self.seen, self.action = stage, after, 0, action
        self.outcomes: list[tuple[str, int | None]] = []
        self.fences: list[str] = []

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        if stage == self.stage:
            self.seen += 1
            if self.seen == self.after:
                if self.action is not None:
                    self.action()
                else:
                    raise InjectedFailure(f"injected failure in {stage}")

    def fence_state(self, state: str) -> None:
        self.fences.append(state)

    def refit_outcome(self, outcome: str, version: int | None) -> None:
        self.outcomes.append((outcome, version))


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (local ports of outgoing connections)."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 just now (held open together, so never the same one twice),
    drawn below the kernel's ephemeral range: a port handed to a process that binds it seconds later cannot
    meanwhile become some outgoing connection's local port (it did once, in CI: an agent could not bind)."""
    low, draw = _ephemeral_low(), random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(100 * n):
            port = draw.randrange(max(1024, low - 12_000), low)
            if len(ports) == n:
                break
            if port in ports:
                continue
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken (or in TIME_WAIT): draw another
            ports.append(port)
        if len(ports) < n:
            raise RuntimeError(f"found only {len(ports)} of {n} free ports below {low}")
        return ports


def mlp(seed: int, width: int = 64, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)).to(dtype)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(model: torch.nn.Module | dict, expected: dict[str, torch.Tensor]) -> bool:
    got = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else model
    return set(got) == set(expected) and all(torch.equal(got[n].detach(), expected[n]) for n in expected)


def free_addresses(n: int) -> list[str]:
    """``n`` distinct loopback TCP addresses free a moment ago."""
    return [f"tcp://127.0.0.1:{p}" for p in free_ports(n)]


@pytest.fixture
def ident() -> rf.Identity:
    return rf.Identity(model="tiny-mlp")


@pytest.fixture
def registry() -> rf.Registry:
    return rf.Registry()

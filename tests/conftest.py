"""Shared fixtures: a tiny trainer/server pair, an embedded registry, and failure-injecting observers."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
import torch

import refitflow as rf
from refitflow.metrics import NullObserver


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


def mlp(seed: int, width: int = 64, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)).to(dtype)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(model: torch.nn.Module | dict, expected: dict[str, torch.Tensor]) -> bool:
    got = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else model
    return set(got) == set(expected) and all(torch.equal(got[n].detach(), expected[n]) for n in expected)


def free_addresses(n: int) -> list[str]:
    """``n`` loopback TCP addresses free a moment ago."""
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(f"tcp://127.0.0.1:{s.getsockname()[1]}")
    return out


@pytest.fixture
def ident() -> rf.Identity:
    return rf.Identity(model="tiny-mlp")


@pytest.fixture
def registry() -> rf.Registry:
    return rf.Registry()

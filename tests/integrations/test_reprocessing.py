"""The preparer that processes vLLM's transformed layers before the vote (``integrations/vllm/worker/reprocessing.py``).

A real publisher and receiver (in process, loopback transport); vLLM's processing itself is replaced here by a
function that copies the staged bytes (or fails): it needs a model vLLM loaded, and the real path is checked on
the real server (``test_vllm_cpu_server.py``, a Mixtral whose experts the CPU backend prepacks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import refitflow as rf
from refitflow.core.errors import RefitError
from refitflow.integrations.vllm.worker import kernels
from refitflow.integrations.vllm.worker.reprocessing import Reprocessing

NUMEL = 256


class Kernel(torch.nn.Module):
    """A layer whose kernel tensor differs from its loading layout (``packed`` = 2 × the loaded weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.packed = torch.nn.Parameter(torch.zeros(NUMEL), requires_grad=False)


def fake_process(fail: set[int]) -> Any:
    def process(layer: kernels.KernelLayer, staged: dict[str, torch.Tensor]) -> kernels.Processed:
        if int(staged["weight"][0].item()) in fail:
            raise ValueError("the backend refused these weights")
        return kernels.Processed(layer, {"packed": staged["weight"] * 2}, {"handle": int(staged["weight"][0])})

    return process


async def versions(monkeypatch: pytest.MonkeyPatch, *, fail_process: set[int] = frozenset(),
                   fail_install: set[int] = frozenset()) -> list[tuple[int, str, float, str]]:  # fmt: skip
    """Publish versions 1..3 (weights all equal to the version) and prepare/finish each through Reprocessing;
    per version: committed version, fence, the kernel's first value, the error (if any)."""
    monkeypatch.setattr(kernels, "process", fake_process(set(fail_process)))
    real_install = kernels.install

    def install(processed: kernels.Processed) -> None:
        if int(processed.attributes["handle"]) in fail_install:
            raise RuntimeError("copy into the kernel failed")
        real_install(processed)

    monkeypatch.setattr(kernels, "install", install)
    module = Kernel()
    staging = torch.zeros(NUMEL)
    layer = kernels.KernelLayer("layers.0.mlp", module, "FakeMethod", "packs its weight", {"weight": staging})
    registry, ident = rf.Registry(), rf.Identity(model="reprocessing")
    seen = []
    async with (
        rf.Publisher(registry, identity=ident) as pub,
        rf.Receiver(dict(layer.targets()), registry, identity=ident, mode="shadow", budget_bytes=1 << 20) as recv,
    ):
        prep = Reprocessing(recv, [layer])
        for version in (1, 2, 3):
            await pub.publish(version, {"layers.0.mlp.weight": torch.full((NUMEL,), float(version))})
            error = ""
            try:
                txn, _ = await prep.prepare(version, timeout=30)
                await prep.finish(txn)
            except RefitError as exc:
                error = str(exc)
            seen.append((recv.ledger.committed_version, recv.ledger.fence.state.value,
                         float(module.packed[0]), error))  # fmt: skip
            assert module.__dict__.get("handle") == (int(module.packed[0]) // 2 or None)  # attributes move with it
            await pub.released(version, timeout=10)
    return seen


@pytest.mark.asyncio
async def test_processed_before_the_vote_and_installed_at_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = await versions(monkeypatch)
    assert [(v, fence, value) for v, fence, value, _ in seen] == [(1, "ready", 2.0), (2, "ready", 4.0),
                                                                   (3, "ready", 6.0)]  # fmt: skip


@pytest.mark.asyncio
async def test_a_processing_failure_fails_the_ballot_and_the_last_version_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = await versions(monkeypatch, fail_process={2})
    assert seen[1][:3] == (1, "ready", 2.0)  # version 2 never committed, nothing live changed
    assert "vLLM's processing of the new version failed" in seen[1][3] and "refused these weights" in seen[1][3]
    assert seen[2][:3] == (3, "ready", 6.0)  # the next good version commits


@pytest.mark.asyncio
async def test_an_install_failure_fences_until_a_later_version(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = await versions(monkeypatch, fail_install={2})
    assert seen[1][0] == 2 and seen[1][1] == "fenced"  # committed, partly installed: fenced
    assert "installing the processed layers of version 2 failed" in seen[1][3]
    assert seen[2][:3] == (3, "ready", 6.0)

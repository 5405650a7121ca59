"""The state a receiving rank keeps across refits, wired to its observer (pull and push receivers alike)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from refitflow.layouts.canonical import LocalTensor
from refitflow.metrics import Observer
from refitflow.refit.budget import ByteBudget
from refitflow.refit.destination import ApplyMode, Destination, ShadowCommit
from refitflow.refit.device import DeviceLane, check_device
from refitflow.refit.fence import Fence
from refitflow.refit.transaction import Ledger

__all__ = ["RankState"]


@dataclass(frozen=True, kw_only=True)
class RankState:
    destination: Destination
    fence: Fence
    budget: ByteBudget
    ledger: Ledger
    devices: DeviceLane  # refit streams and events of the destination's devices

    @classmethod
    def build(
        cls,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        mode: ApplyMode,
        layout: Mapping[str, LocalTensor] | None,
        budget_bytes: int,
        observer: Observer,
        *,
        shadow_commit: ShadowCommit = ShadowCommit.SWAP,
        quant: Mapping[str, str] | None = None,
    ) -> RankState:
        """The destination parameters, their devices, fence, staging budget and ledger; changes reported."""
        destination = Destination(model, mode, layout, shadow_commit=shadow_commit, quant=quant)
        for name, tensor in destination.params.items():  # a rank refits CPU and CUDA memory only
            check_device(tensor.device, f"destination parameter {name!r}")
        fence = Fence(on_change=lambda state: observer.fence_state(state.value))
        budget = ByteBudget(
            budget_bytes, on_change=lambda s: observer.budget(s.used_bytes, s.peak_bytes, s.capacity_bytes)
        )
        return cls(destination=destination, fence=fence, budget=budget, ledger=Ledger(destination, fence),
                   devices=DeviceLane(destination.devices))  # fmt: skip

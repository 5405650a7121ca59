"""``Destination.target_bytes``: the byte view of the storage the next version is written into — made once
per storage, and still right after shadow swaps (the two storages alternate)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refitflow.refit.destination import ApplyMode, Destination, ShadowCommit


@pytest.mark.parametrize("mode", [ApplyMode.IN_PLACE, ApplyMode.SHADOW])
def test_the_byte_view_follows_the_target_storage_across_swaps(mode: ApplyMode) -> None:
    model = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    d = Destination(model, mode, shadow_commit=ShadowCommit.SWAP)
    for _ in range(4):  # in place: always the live tensor; shadow: the storage that is not live
        for name in model:
            view = d.target_bytes(name)
            assert view.dtype == torch.uint8 and view.dim() == 1
            assert view.data_ptr() == d.target(name).data_ptr() and view.numel() == d.target(name).nbytes
            assert view is d.target_bytes(name)  # made once per storage
            memory = d.target_memory(name)
            assert memory is not None and memory is d.target_memory(name)
            assert np.frombuffer(memory, dtype=np.uint8).ctypes.data == view.data_ptr()  # the same storage
            if mode is ApplyMode.SHADOW:
                assert view.data_ptr() != d.live(name).data_ptr()
        if mode is ApplyMode.SHADOW:
            d.swap()

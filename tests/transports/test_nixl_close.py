"""A closed NIXL transport lets go of its agent at once: a receiver whose refit failed (its error, with the
traceback that references the pipeline, still held) leaves no descriptor open after it closes."""

from __future__ import annotations

import os

import anyio
import pytest
import torch

import refitflow as rf


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.asyncio
async def test_a_closed_receiver_leaves_no_descriptor_behind_even_when_its_error_is_kept() -> None:
    identity, model = rf.Identity(model="fds"), {"w": torch.zeros(4)}
    kept: list[BaseException] = []  # the errors, with their tracebacks: what used to keep the agent alive
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            async with rf.Receiver(model, server.address, identity=identity, transport="nixl"):
                pass  # the first one loads what stays loaded (libraries, UCX's own)
            await anyio.sleep(0.5)
            before = open_fds()
            for _ in range(3):
                async with rf.Receiver(model, server.address, identity=identity, transport="nixl") as rcv:
                    try:
                        await rcv.refit(timeout=0.3)  # nothing published: a timeout
                    except rf.RefitTimeoutError as exc:
                        kept.append(exc)
                await anyio.sleep(0.5)
            assert len(kept) == 3
            assert open_fds() <= before, open_fds() - before

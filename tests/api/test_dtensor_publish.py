"""DTensor parameters published without gathering: the placements give each rank's box.

The end-to-end test runs two real FSDP2 (``fully_shard``) trainer processes over gloo, each
publishing its local shards over NIXL; this process receives the whole model bit-exact.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import refitflow as rf
from refitflow.api.dtensor import chunk_range, shard_box
from tests.api._fsdp_rank import IDENTITY, VERSIONS, run_rank, shapes
from tests.conftest import free_ports

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before nixl (UCX) is first imported; children inherit it


def test_chunk_ranges_are_torch_chunks_including_short_and_empty_last_ones() -> None:
    for size in range(0, 12):
        for chunks in range(1, 6):
            pieces = torch.arange(size).chunk(chunks) if size else ()
            got = [chunk_range(size, chunks, i) for i in range(chunks)]
            assert [(int(p[0]), int(p[-1]) + 1) for p in pieces] == [r for r in got if r[0] < r[1]]
            assert all(start == stop for start, stop in got[len(pieces) :])


def test_shard_box_follows_the_one_sharded_mesh_dimension() -> None:
    # HSDP: replicated over mesh dim 0, sharded over mesh dim 1 (7 rows in 2: 4 + 3)
    assert shard_box("w", (7, 3), (2, 2), (1, 1), [Replicate(), Shard(0)]) == (0, 4, 7)
    assert shard_box("w", (7, 3), (2, 2), (0, 1), [Replicate(), Shard(-1)]) == (1, 2, 3)
    assert shard_box("w", (7, 3), (2, 2), (1, 0), [Replicate(), Replicate()]) == (None, 0, 7)
    # a mesh dimension of size 1 splits nothing
    assert shard_box("w", (7, 3), (1, 2), (0, 1), [Shard(1), Shard(0)]) == (0, 4, 7)


@pytest.mark.parametrize(
    ("placements", "words"),
    [
        ([Partial()], "Partial"),
        ([_StridedShard(0, split_factor=2)], "not supported"),
        ([Shard(0), Shard(1)], "split it over 2 mesh dimensions"),
        ([Shard(0), Shard(0)], "split it over 2 mesh dimensions"),
    ],
)
def test_unsupported_placements_are_config_errors_naming_the_tensor(placements: list[Any], words: str) -> None:
    mesh = (2,) * len(placements)
    with pytest.raises(rf.ConfigError, match=words) as info:
        shard_box("layers.0.w", (8, 8), mesh, (0,) * len(mesh), placements)
    assert "'layers.0.w'" in str(info.value)


@pytest.mark.asyncio
async def test_fsdp2_ranks_publish_local_shards_and_a_receiver_gets_the_model_bit_exact(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    dst = {n: torch.zeros(s) for n, s in shapes().items()}
    with anyio.fail_after(300):  # two spawned processes importing torch and nixl on a loaded machine
        async with (
            rf.Registry.serve("tcp://127.0.0.1:*") as server,
            rf.Receiver(dst, server.address, identity=IDENTITY, transport="nixl") as recv,
        ):
            (port,) = free_ports(1)
            procs = [ctx.Process(target=run_rank, args=(r, port, server.address, str(tmp_path), queue)) for r in (0, 1)]
            for p in procs:
                p.start()

            async def event() -> tuple[int, str, Any]:
                rank, kind, value = await anyio.to_thread.run_sync(queue.get, True, 240)
                assert kind != "error", f"rank {rank}: {value}"
                return rank, kind, value

            try:
                for version in VERSIONS:
                    held = dict([(await event())[::2], (await event())[::2]])  # rank -> its shards
                    result = await recv.refit(version, timeout=120)
                    assert result.version == version
                    expected = torch.load(tmp_path / f"v{version}.pt")
                    for name, t in expected.items():
                        assert torch.equal(dst[name], t), name
                reports: dict[int, Any] = {}
                while len(reports) < 2:  # each rank's "partial", then its "done": they interleave across ranks
                    rank, kind, value = await event()
                    if kind == "partial":
                        reports[rank] = value
            finally:
                for p in procs:
                    await anyio.to_thread.run_sync(p.join, 60)
                    if p.exitcode is None:  # hung: never outlive the test
                        p.kill()
    # each rank published only its local box: uneven 4 + 3 rows, 2 + 1 rows, an empty chunk left out
    assert held[0]["up.weight"] == (0, 0, 4) and held[1]["up.weight"] == (0, 4, 7)
    assert held[0]["down.bias"] == (0, 0, 2) and held[1]["down.bias"] == (0, 2, 3)
    assert held[0]["embed.weight"] == (0, 0, 1) and "embed.weight" not in held[1]
    assert held[0]["columns"] == (1, 0, 3) and held[1]["columns"] == (1, 3, 5)
    assert held[0]["replicated"] == held[1]["replicated"] == (None, 0, 3)  # identical sources: replicas
    for rank in (0, 1):  # a Partial tensor is refused before anything is announced
        kind, message, published = reports[rank]
        assert kind == "ConfigError" and "'partial'" in message and "Partial" in message
        assert published == list(VERSIONS)
    assert all(p.exitcode == 0 for p in procs)

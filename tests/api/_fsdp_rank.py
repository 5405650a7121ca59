"""One FSDP2 trainer rank (``fully_shard`` over a 2-rank gloo mesh on the CPU) publishing its DTensor
parameters over NIXL without gathering them; the test process receives.

Each rank trains one SGD step per version, saves the gathered truth (``full_tensor``, rank 0, to
``<dir>/v<version>.pt``: for the test's comparison only), publishes its local shards, reports, and
waits for the receiver's release. Its reports go on ``queue`` as ``(rank, event, value)``.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

import refitflow as rf

IDENTITY = rf.Identity(model="fsdp2-tiny")
VERSIONS = (1, 2)


class Tiny(torch.nn.Module):
    """Every FSDP2 shard shape worth a test on 2 ranks: 7 rows (4 + 3), 3 rows (2 + 1), 1 row (1 + 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1, 6)  # 1 row: rank 1 holds an empty chunk
        self.up = torch.nn.Linear(6, 7)
        self.down = torch.nn.Linear(7, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(idx))))


def shapes() -> dict[str, tuple[int, ...]]:
    """Every published tensor's global shape (the receiver's parameters)."""
    own = {n: tuple(p.shape) for n, p in Tiny().named_parameters()}
    return own | {"replicated": (3, 4), "columns": (4, 5)}


async def _publish(rank: int, address: str, out: Path, queue: Any) -> None:
    with anyio.fail_after(240):  # every wait below has its own deadline too
        await _train_and_publish(rank, address, out, queue)


async def _train_and_publish(rank: int, address: str, out: Path, queue: Any) -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = Tiny()
    for part in (model.up, model.down, model):
        fully_shard(part, mesh=mesh)
    extras = {  # not FSDP: a replicated tensor, and one split by columns (a strided read on the receiver)
        "replicated": distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Replicate()]),
        "columns": distribute_tensor(torch.randn(4, 5), mesh, [Shard(1)]),
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    async with rf.Publisher(address, identity=IDENTITY, rank=rank, world_size=2, transport="nixl") as pub:
        for version in VERSIONS:
            model(torch.zeros(2, dtype=torch.long)).square().sum().backward()
            opt.step()  # in place: the local shards keep their storage (registered once)
            opt.zero_grad()
            tensors: dict[str, torch.Tensor] = {**dict(model.named_parameters()), **extras}
            assert all(isinstance(t, DTensor) for t in tensors.values())
            full = {n: t.full_tensor().detach().clone() for n, t in tensors.items()}  # a collective: every rank
            if rank == 0:
                torch.save(full, out / f"v{version}.pt")
            manifest = await pub.publish(version, tensors)
            queue.put((rank, "published", {s.name: (s.axis, s.start, s.stop) for s in manifest.shards}))
            await pub.released(version, timeout=120)
        partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
        try:
            await pub.publish(3, {"partial": partial})
        except rf.ConfigError as exc:
            queue.put((rank, "partial", (type(exc).__name__, str(exc), pub.published)))
        else:
            queue.put((rank, "partial", ("published", "", pub.published)))


def run_rank(rank: int, port: int, address: str, out: str, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        anyio.run(_publish, rank, address, Path(out), queue)
    except BaseException as exc:
        queue.put((rank, "error", repr(exc)))
    queue.put((rank, "done", None))
    queue.close()
    queue.join_thread()
    dist.destroy_process_group()

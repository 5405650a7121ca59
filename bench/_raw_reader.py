"""A bench role: raw NIXL READs of every shard of the last version straight into this process's parameters.

No pipeline at all (no plan, staging, verify or commit): the same bytes landing in the same places as
refitflow's in-place receiver, so its time is the limit of refitflow's receiving side.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from refitflow.cli.demo_roles import IDENTITY, Report, RoleConfig, peak_rss_bytes, weights_digest
from refitflow.cli.synthetic import synthetic_shapes
from refitflow.core.types import ShardSpec
from refitflow.registry.client.connect import connect_registry
from refitflow.transports.base import Read, as_bytes
from refitflow.transports.nixl import NixlTransport

READS = 6  # the first is cold (connections, descriptors); the best of the rest is the figure


def _landing(model: dict[str, torch.Tensor], shard: ShardSpec) -> torch.Tensor:
    """The bytes of ``model`` a shard of the demo's trainer covers (whole tensors or row ranges)."""
    tensor = model[shard.name]
    if shard.dtype != "bfloat16" or shard.axis not in (None, 0):
        raise ValueError(f"the raw reader takes whole or row-sharded bf16 tensors, got {shard!r:.200}")
    dst = as_bytes(tensor if shard.axis is None else tensor[shard.start : shard.stop])
    if dst.numel() != shard.nbytes:
        raise ValueError(f"{shard.name}: the shard holds {shard.nbytes} bytes, its place here {dst.numel()}")
    return dst


async def raw_reader_role(name: str, mode: str, address: str, cfg: RoleConfig, report: Report) -> None:
    device = cfg.receiver_device or cfg.device
    shapes = synthetic_shapes(cfg.size_bytes)
    model = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    registry: Any = connect_registry(address)
    transport = NixlTransport()
    try:
        await registry.register_receiver(IDENTITY, name)
        for version in range(1, cfg.versions):  # let the publisher go on to its last version
            await registry.wait_complete(IDENTITY, version, cfg.timeout_s)
            await registry.report(IDENTITY, name, version)
        pub = await registry.wait_complete(IDENTITY, cfg.versions, cfg.timeout_s)
        for tensor in model.values():
            transport.register(tensor)
        reads = []
        for m in pub.manifests:
            transport.connect(m.source)
            reads += [Read(m.source.agent, s.region, s.offset, s.nbytes, _landing(model, s)) for s in m.shards]
        seconds = []
        for _ in range(READS):
            t0 = time.perf_counter()
            await transport.read(reads, key="all")  # returns when every byte has landed (also in VRAM)
            seconds.append(time.perf_counter() - t0)
        report({"kind": "raw", "name": name, "seconds": seconds, "nbytes": sum(r.nbytes for r in reads),
                "rss": peak_rss_bytes(), "digest": weights_digest(model)})  # fmt: skip
        await registry.report(IDENTITY, name, cfg.versions)
    finally:
        await transport.aclose()
        await registry.aclose()

"""A bench role: raw NIXL READs of every shard of version 1 into local tensors (no pipeline at all)."""

from __future__ import annotations

import time
from typing import Any

import torch

from refitflow.cli.demo_roles import IDENTITY, Report, RoleConfig
from refitflow.registry.connect import connect_registry
from refitflow.transports.base import Read, as_bytes
from refitflow.transports.nixl import NixlTransport


async def raw_reader_role(name: str, mode: str, address: str, cfg: RoleConfig, report: Report) -> None:
    registry: Any = connect_registry(address)
    transport = NixlTransport()
    try:
        await registry.register_receiver(IDENTITY, name)
        pub = await registry.wait_complete(IDENTITY, 1, cfg.timeout_s)
        reads = []
        for m in pub.manifests:
            transport.connect(m.source)
            for s in m.shards:
                dst = torch.empty(s.nbytes, dtype=torch.uint8, device=cfg.receiver_device or cfg.device)
                transport.register(dst)
                reads.append(Read(m.source.agent, s.region, s.offset, s.nbytes, as_bytes(dst)))
        nbytes, times = sum(r.nbytes for r in reads), []
        for _ in range(6):
            t0 = time.perf_counter()
            await transport.read(reads, key="all")  # returns when every byte has landed (also in VRAM)
            times.append(time.perf_counter() - t0)
        report({"kind": "raw", "name": name, "first_gbps": nbytes / times[0] / 1e9,
                "gbps": nbytes / min(times[1:]) / 1e9, "nbytes": nbytes})  # fmt: skip
        for version in range(1, cfg.versions + 1):  # let the publisher go on through its versions
            await registry.report(IDENTITY, name, version)
            if version < cfg.versions:
                await registry.wait_complete(IDENTITY, version + 1, cfg.timeout_s)
    finally:
        await transport.aclose()
        await registry.aclose()

"""Re-route reads off a replica source that failed, onto the trainer ranks holding the same bytes.

A replica serves whole tensors with the trainer's digests, so a byte range of a replica's tensor is
the same byte range of the trainer's copy of that tensor: the read keeps its destination and only
its source changes. Verification is unchanged (same digests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from refitflow.core.errors import TransportError
from refitflow.core.types import Publication, ShardSpec
from refitflow.transports.base import Read

__all__ = ["Rerouter"]


class Rerouter:
    def __init__(self, pub: Publication) -> None:
        self.replicas = {m.source.agent: m for m in pub.replicas}
        self.trainer: dict[str, tuple[str, ShardSpec]] = {
            s.name: (m.source.agent, s) for m in pub.manifests for s in m.shards if s.axis is None
        }
        self.avoid: set[str] = set()  # replica agents that failed during this attempt

    def is_replica(self, read: Read) -> bool:
        return read.peer in self.replicas

    def to_trainer(self, read: Read) -> Read:
        """The same bytes, from the trainer (``TransportError`` if no trainer rank holds them whole)."""
        for spec in self.replicas[read.peer].shards:
            if spec.region == read.region and spec.offset <= read.offset < spec.offset + spec.nbytes:
                if read.offset + read.extent > spec.offset + spec.nbytes or spec.name not in self.trainer:
                    break
                agent, t = self.trainer[spec.name]
                return replace(read, peer=agent, region=t.region, offset=t.offset + read.offset - spec.offset)
        raise TransportError(f"no trainer source holds the bytes of replica {read.peer!r} region {read.region}")

    def avoiding(self, reads: Sequence[Read]) -> list[Read]:
        """``reads`` with those from replicas known to have failed moved to the trainer."""
        return [self.to_trainer(r) if r.peer in self.avoid else r for r in reads]

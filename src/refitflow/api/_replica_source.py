"""A receiver's committed copy described as a replica source of its version (tree fan-out)."""

from __future__ import annotations

from dataclasses import replace

from refitflow.core.dtypes import dtype_name
from refitflow.core.types import Manifest, Publication
from refitflow.pipeline.destination import Destination
from refitflow.registry.replicas import REPLICA_KEY
from refitflow.transports import Transport

__all__ = ["replica_manifest"]


def replica_manifest(
    pub: Publication, destination: Destination, transport: Transport, receiver_id: str
) -> Manifest | None:
    """The manifest offering ``destination``'s live tensors as ``pub``'s bytes, or None when they are not
    byte-identical to the published ones (a sharded publication, or a cast on the way in)."""
    shards = []
    for m in pub.manifests:
        for spec in m.shards:
            param = destination.canonical.get(spec.name)
            if spec.axis is not None or param is None:
                return None
            live = destination.params[param].detach()
            if dtype_name(live.dtype) != spec.dtype or tuple(live.shape) != spec.global_shape:
                return None
            region = transport.register(live)  # idempotent: both storages were registered up front
            shards.append(replace(spec, region=region, offset=0))  # the same bytes: the same digests
    return Manifest(
        identity=pub.identity, version=pub.version, rank=0, world_size=1, source=transport.address(),
        shards=tuple(shards), metadata={REPLICA_KEY: receiver_id},
    )  # fmt: skip

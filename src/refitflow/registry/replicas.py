"""Replica sources (tree fan-out): which manifests may serve a version a receiver committed.

A replica manifest announces a receiver's committed copy of a version: whole tensors, each with the
dtype, shape and digests (algorithm, tiles) the trainer published, at the receiver's own transport address.
``metadata["replica"]`` names the receiver, so its replicas go when it unregisters or its lease
expires. Only publications whose every tensor is published whole can have replicas (the copy is
then byte-identical to the trainer's).
"""

from __future__ import annotations

from refitflow.core.errors import ManifestError
from refitflow.core.types import Manifest, Publication

__all__ = ["REPLICA_KEY", "check_replica"]

REPLICA_KEY = "replica"


def check_replica(pub: Publication, replica: Manifest) -> None:
    """Raise ``ManifestError`` unless ``replica`` holds exactly ``pub``'s tensors, whole, same digests."""
    if REPLICA_KEY not in replica.metadata:
        raise ManifestError("a replica manifest names its receiver in metadata['replica']", version=replica.version)
    published = {s.name: s for m in pub.manifests for s in m.shards}
    offered = {s.name: s for s in replica.shards}
    if set(offered) != set(published):
        missing = sorted(set(published) - set(offered))[:20]
        extra = sorted(set(offered) - set(published))[:20]
        raise ManifestError(f"a replica must hold every tensor: missing {missing}, unknown {extra}",
                            version=replica.version)  # fmt: skip
    for name, s in offered.items():
        t = published[name]
        if t.axis is not None or s.axis is not None:
            raise ManifestError("only whole tensors can be served by replicas", tensor=name, version=replica.version)
        same = ("dtype", "global_shape", "digest", "algo", "tile_rows", "tile_cols", "blocks")
        if any(getattr(s, f) != getattr(t, f) for f in same):
            raise ManifestError("a replica's tensor differs from the published one", tensor=name,
                                version=replica.version)  # fmt: skip

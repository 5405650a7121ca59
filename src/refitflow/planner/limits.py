"""What a plan is bounded by: bucket sizes, reads per bucket, casts allowed, how pieces are cut and checked.

``rf.ReceiverConfig`` (``refit/config.py``) documents each field for users and makes one of these; it is part
of a plan's cache key, so a plan is replayed only under the limits it was built for.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits"]


@dataclass(frozen=True, kw_only=True)
class Limits:
    bucket_bytes: int
    direct_bucket_bytes: int
    max_reads_per_bucket: int
    lossy_casts: bool
    read_timeout_s: float
    relay_wait_s: float = 5.0  # how long a reader waits for an upstream relay that makes no progress
    skip_unchanged: bool = True  # delta refits: leave pieces whose digests did not change (planner/delta.py)
    recheck_fraction: float = 0.125  # of skipped pieces, re-hashed each refit (rotating)
    read_early: bool = True  # read a version announced before its digests; compare when they arrive
    verify: str = "strict"  # strict: widen partial pulls to whole digest blocks; pulled: verify what is whole
    max_strided_runs: int = 1024  # contiguous runs per piece of a strided (column) read
    min_run_bytes: int = 32  # strided runs shorter than this read the enclosing rows instead
    descriptor_bytes: int = 16 << 10  # read whole rows when they add fewer bytes than this per descriptor saved
    max_row_factor: int = 8  # ... and are at most this many times the box's bytes
    compile_targets: tuple[str, ...] | None = None  # None: any
    compile_metadata: tuple[tuple[str, str], ...] = ()  # required subset
    max_direct_buckets: int = 2048  # more direct bytes than this many batches hold: larger batches
    read_start: float = 0.0  # where in its slice (a fraction of its bytes) the plan starts, wrapping round

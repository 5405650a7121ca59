"""Receiver configuration: one frozen, keyword-only dataclass, validated with sentences."""

from __future__ import annotations

from dataclasses import dataclass

from refitflow.core.errors import ConfigError
from refitflow.planner.limits import Limits
from refitflow.refit.destination import ApplyMode, ShadowCommit

__all__ = ["ReceiverConfig"]

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """A receiver's options (``rf.Receiver(..., **options)`` passes them here); each is checked on creation.

    - ``budget_bytes`` (256 MiB): staging memory this rank may hold at once; a tensor larger than it
      streams through in pieces. Reads that need no translation land in the parameters and use none.
    - ``bucket_bytes`` (half the budget, at most 32 MiB): the staging size of one bucket, the unit that
      flows through the stages; two buckets in flight overlap pulling with applying.
    - ``direct_bucket_bytes`` (64 MiB): how many bytes of direct reads (no staging) go in one batch.
    - ``max_direct_buckets`` (2048): a rank whose direct bytes would fill more batches than this makes them
      larger (its direct bytes / this): every batch costs a fixed ≈ 0.5–1 ms (a worker-thread hop, the
      transport's post and completion, verify's hop), seconds per refit over the 6,000 batches of a 1/16
      slice of a 3-T-parameter model at 64 MiB. The relay cap (``relay_bucket_bytes``) gives way to it too.
    - ``max_reads_per_bucket`` (4096): reads handed to the transport in one call.
    - ``mode`` (``"in_place"``): ``"in_place"`` writes the live parameters behind the fence (a failure
      leaves the rank fenced); ``"shadow"`` writes a copy and swaps it in at commit (a failure leaves the
      old version serving; twice the parameter memory).
    - ``shadow_commit`` (``"swap"``): how a shadow version becomes live: ``"swap"`` swaps ``param.data``
      (instant; raw pointers captured before, as in CUDA graphs, keep the old storage); ``"copy"``
      copies the shadow into the live storage on the device at commit (pointers kept; the fence is
      ``updating`` for one device copy). Only with ``mode="shadow"`` (see docs/device.md).
    - ``lossy_casts`` (False): allow casts that lose precision (e.g. fp32 published, bf16 served);
      otherwise such a cast is a ``PlanError`` before any byte is read.
    - ``stream_depth`` (2): items buffered between two stages.
    - ``window_buckets`` (the staging budget over a bucket, at least 4, at most 64): buckets whose reads are in
      flight at once in the pull stage — submitted to the transport, not yet landed. Staged buckets are
      bounded by the budget as well; direct ones (no staging) by this alone.
    - ``read_timeout_s`` (60): deadline of one bucket's reads; past it the refit aborts.
    - ``refit_timeout_s`` (600): deadline of a whole refit, discovery included.
    - ``verify`` (``"strict"``): ``"strict"`` widens reads to whole digest blocks so that every pulled
      byte is checked against the publisher's digests; ``"pulled"`` reads exactly this rank's slice and
      checks the blocks that arrived whole (``RefitResult.unverified_bytes`` counts the rest).
    - ``max_strided_runs`` (1024): row runs per piece when a column slice is read as strided runs.
    - ``min_run_bytes`` (32): runs shorter than this read the enclosing rows into staging instead.
    - ``descriptor_bytes`` (16 KiB): what one read descriptor costs, in bytes of the link. A column slice of a
      row-major shard is one descriptor per row; its whole rows are read into staging instead (and the slice
      copied out) when they add fewer bytes than this for each descriptor they save — e.g. a TP 16 rank's
      slice of a TP 8 trainer's ``o_proj``: one descriptor for 7,168 rows, twice the bytes. 0: never. The
      break-even is a descriptor's cost times the link's rate: ≈ 2.8 µs over CMA here (≈ 36 KB of copy; 140 KB
      at 50 GB/s); 16 KiB is 0.33 µs at 50 GB/s, so the default costs little where descriptors are as cheap as
      that (Llama-70B TP 1 → 8: 1.53× the slice's bytes for half the descriptors) and saves much where they are
      not (DeepSeek-V3 TP 32: 461,884 descriptors a rank → 3,389, simulated 1.52 → 1.22 s; docs/scale.md). A GPU
      server's figure is ``bench/nixl_fit.py``'s there.
    - ``max_row_factor`` (8): whole rows are read instead only when they are at most this many times the slice's
      bytes — every rank of a TP 32 engine reading a TP 1 trainer's whole ``o_proj`` would be 32 copies of it
      from the trainer, whose links then bound the refit.
    - ``compile_targets`` (None: any): the compile targets this rank accepts; another is a ``PlanError``.
    - ``compile_metadata`` (none): items every accepted shard's compile metadata must contain.
    - ``relay_wait_s`` (5): how long this rank waits for an upstream relay that makes no progress before it
      reads the rest of the version from the trainer (pipelined fan-out, docs/fanout.md).
    - ``relay_bucket_bytes`` (4 MiB): with ``serve_replicas``, the bucket size cap (staged and direct): a
      relay serves a tensor once the bucket that completes it is verified.
    - ``skip_unchanged`` (True): delta refits — pieces whose every digest block is unchanged since the
      version this rank holds are not pulled (docs/fanout.md).
    - ``recheck_fraction`` (0.125): of the pieces skipped, the share re-hashed where they lie each refit,
      rotating (each at least once every 1 / fraction refits; 1.0: all, every refit; 0: never).
    - ``read_early`` (True): a version announced before its digests (``Publisher(announce_early=True)``)
      is read at once; verify hashes as the bytes land and compares once the digests arrive (within
      ``read_timeout_s``), and nothing of that version is skipped as unchanged. False: wait for the
      digests (delta refits keep skipping). A rank that serves replicas always waits (relays serve
      verified bytes).
    - ``read_start`` (0): where in its slice (a fraction of its bytes, in plan order) this rank starts
      reading, wrapping round to the beginning, beyond its place. Plans go in layer order; a rank with a
      layout starts at its place in the model (rank r of a TP n engine at r / n: ``planner.sources.place_of``,
      at a shard boundary that cuts no parameter), so the ranks of an engine read different pipeline stages of
      the trainer at once, and among a tensor's replicas starts at the same place. Engines of whole tensors (no
      layout) read the trainer's stages in the same order unless engine e of E starts at e / E
      (``VllmFleet.init`` sets that). Relays chain ranks of one layout, which read in one order: 0 with
      ``serve_replicas``.
    """

    budget_bytes: int = 256 * MiB
    bucket_bytes: int | None = None  # default: half the budget, at most 32 MiB (two buckets in flight)
    direct_bucket_bytes: int = 64 * MiB  # direct reads use no staging; this only sizes their batches
    max_reads_per_bucket: int = 4096
    max_direct_buckets: int = 2048
    mode: ApplyMode = ApplyMode.IN_PLACE
    shadow_commit: ShadowCommit = ShadowCommit.SWAP  # "copy": CUDA-graph safe shadow (see docs/device.md)
    lossy_casts: bool = False
    stream_depth: int = 2
    window_buckets: int | None = None  # default: budget // bucket, within [4, 64]
    read_timeout_s: float = 60.0
    refit_timeout_s: float = 600.0
    verify: str = "strict"
    max_strided_runs: int = 1024
    min_run_bytes: int = 32
    descriptor_bytes: int = 16 << 10
    max_row_factor: int = 8
    compile_targets: tuple[str, ...] | None = None
    compile_metadata: tuple[tuple[str, str], ...] = ()
    relay_wait_s: float = 5.0
    relay_bucket_bytes: int = 4 * MiB
    skip_unchanged: bool = True
    recheck_fraction: float = 0.125
    read_early: bool = True
    read_start: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _mode(self.mode))
        object.__setattr__(self, "shadow_commit", _shadow_commit(self.shadow_commit, self.mode))
        if not isinstance(self.budget_bytes, int) or self.budget_bytes < 64:
            raise ConfigError(f"budget_bytes must be an integer of at least 64 bytes, got {self.budget_bytes!r}")
        if self.bucket_bytes is None:
            object.__setattr__(self, "bucket_bytes", max(64, min(self.budget_bytes // 2, 32 * MiB)))
        assert self.bucket_bytes is not None
        if not 64 <= self.bucket_bytes <= self.budget_bytes:
            raise ConfigError(
                f"bucket_bytes must lie between 64 and budget_bytes ({self.budget_bytes}), got {self.bucket_bytes}"
            )
        if self.direct_bucket_bytes < 64:
            raise ConfigError("direct_bucket_bytes must be at least 64 bytes")
        if self.max_reads_per_bucket < 1 or self.stream_depth < 1 or self.max_direct_buckets < 1:
            raise ConfigError("max_reads_per_bucket, max_direct_buckets and stream_depth must be at least 1")
        if self.window_buckets is None:
            object.__setattr__(self, "window_buckets", min(64, max(4, self.budget_bytes // self.bucket_bytes)))
        window = self.window_buckets
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"window_buckets must be a whole number of at least 1, got {self.window_buckets!r}")
        if self.verify not in ("strict", "pulled"):
            raise ConfigError(f"verify must be 'strict' or 'pulled', got {self.verify!r}")
        if self.max_strided_runs < 1 or self.max_row_factor < 1 or self.min_run_bytes < 0 or self.descriptor_bytes < 0:
            raise ConfigError("max_strided_runs and max_row_factor must be at least 1, min_run_bytes and "
                              "descriptor_bytes not negative")  # fmt: skip
        if isinstance(self.compile_metadata, dict):
            object.__setattr__(self, "compile_metadata", tuple(sorted(self.compile_metadata.items())))
        if self.compile_targets is not None:
            object.__setattr__(self, "compile_targets", tuple(self.compile_targets))
        if self.read_timeout_s <= 0 or self.refit_timeout_s <= 0 or self.relay_wait_s <= 0:
            raise ConfigError("timeouts must be positive numbers of seconds")
        if self.relay_bucket_bytes < 64:
            raise ConfigError("relay_bucket_bytes must be at least 64 bytes")
        if not 0 <= self.recheck_fraction <= 1:
            raise ConfigError(f"recheck_fraction must lie between 0 and 1, got {self.recheck_fraction!r}")
        if (
            isinstance(self.read_start, bool)
            or not isinstance(self.read_start, int | float)
            or not (0 <= self.read_start < 1)
        ):
            raise ConfigError(
                f"read_start is a fraction of a rank's slice, 0 <= read_start < 1, got {self.read_start!r}"
            )

    @property
    def limits(self) -> Limits:
        assert self.bucket_bytes is not None
        return Limits(
            bucket_bytes=self.bucket_bytes,
            direct_bucket_bytes=self.direct_bucket_bytes,
            max_reads_per_bucket=self.max_reads_per_bucket,
            max_direct_buckets=self.max_direct_buckets,
            lossy_casts=self.lossy_casts,
            read_timeout_s=self.read_timeout_s,
            relay_wait_s=self.relay_wait_s,
            skip_unchanged=self.skip_unchanged,
            recheck_fraction=self.recheck_fraction,
            read_start=float(self.read_start),
            read_early=self.read_early,
            verify=self.verify,
            max_strided_runs=self.max_strided_runs,
            min_run_bytes=self.min_run_bytes,
            descriptor_bytes=self.descriptor_bytes,
            max_row_factor=self.max_row_factor,
            compile_targets=self.compile_targets,
            compile_metadata=self.compile_metadata,
        )


def _mode(value: object) -> ApplyMode:
    try:
        return ApplyMode(str(value))
    except ValueError:
        raise ConfigError(f"mode must be 'in_place' or 'shadow', got {value!r}") from None


def _shadow_commit(value: object, mode: ApplyMode) -> ShadowCommit:
    try:
        commit = ShadowCommit(str(value))
    except ValueError:
        raise ConfigError(f"shadow_commit must be 'swap' or 'copy', got {value!r}") from None
    if commit is ShadowCommit.COPY and mode is not ApplyMode.SHADOW:
        raise ConfigError("shadow_commit='copy' applies to mode='shadow' only (in_place keeps every pointer already)")
    return commit

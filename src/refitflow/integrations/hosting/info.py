"""What the RL loop sends a vLLM server running the ``refitflow`` backend (plain data, no vLLM import).

``/init_weight_transfer_engine {"init_info": {...}}`` once, then per step
``/update_weights {"update_info": {"version": v}}``; unknown keys are refused by vLLM's parser.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from refitflow.core.errors import ConfigError

__all__ = ["KV_POLICIES", "LOADERS", "TRANSPORTS", "VOTES", "RefitflowInitInfo", "RefitflowUpdateInfo"]

LOADERS = ("auto", "direct", "load_weights")
VOTES = ("auto", "none", "zmq", "gloo")
TRANSPORTS = ("auto", "nixl")
KV_POLICIES = ("keep", "reset_prefix", "recompute")  # what a no-drain swap does with the KV cache
LORA_ROOT = "/dev/shm/refitflow-lora"  # tmpfs: an adapter version never touches a disk (one root per server on a host)


@dataclass(frozen=True, kw_only=True)
class RefitflowInitInfo:
    """Once per trainer connection; the same on every worker of the server."""

    registry: str  # the refitflow registry's address (tcp://host:port)
    model: str  # the publication's identity: model name ...
    identity: dict[str, str] = field(default_factory=dict)  # ... and its other fields (layout, dtype, ...)
    mode: str = "in_place"  # in_place (a failure fences the engine) or shadow (a failure keeps the old version)
    shadow_commit: str = "copy"  # shadow: copy into the live storage (CUDA-graph safe) or swap storages (eager)
    loader: str = "auto"  # direct (write the live parameters), load_weights (the model's own), auto: direct if it maps
    budget_bytes: int = 256 << 20  # staging bytes per worker (load_weights: also the size of its buckets)
    transport: str = "auto"  # auto or nixl: the registry is another process's, so the reads go over NIXL
    vote: str = "auto"  # the engine vote across the workers: auto (zmq when more than one), none, zmq, gloo
    vote_addresses: list[str] | None = None  # zmq: one per worker (global rank order); None: exchanged at init
    vote_host: str = "127.0.0.1"  # zmq with exchanged addresses: the host this worker's vote socket binds
    vote_timeout_s: float = 30.0
    init_timeout_s: float = 120.0  # creating the transport, registering memory, connecting the registry
    receiver_options: dict[str, Any] = field(default_factory=dict)  # more rf.ReceiverConfig fields

    def __post_init__(self) -> None:
        if not isinstance(self.registry, str) or "://" not in self.registry:
            raise ConfigError(f"registry must be an address such as tcp://host:port, got {self.registry!r}")
        if self.mode not in ("in_place", "shadow"):
            raise ConfigError(f"mode must be 'in_place' or 'shadow', got {self.mode!r}")
        if self.shadow_commit not in ("copy", "swap"):
            raise ConfigError(f"shadow_commit must be 'copy' (CUDA-graph safe) or 'swap' (eager servers), got "
                              f"{self.shadow_commit!r}")  # fmt: skip
        if self.loader not in LOADERS:
            raise ConfigError(f"loader must be one of {LOADERS}, got {self.loader!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS} (the trainer is another process), got "
                              f"{self.transport!r}")  # fmt: skip
        if self.vote not in VOTES:
            raise ConfigError(f"vote must be one of {VOTES}, got {self.vote!r}")
        if self.vote_timeout_s <= 0 or self.init_timeout_s <= 0:
            raise ConfigError("vote_timeout_s and init_timeout_s must be positive numbers of seconds")
        if not isinstance(self.budget_bytes, int) or self.budget_bytes < 64:
            raise ConfigError(f"budget_bytes must be an integer of at least 64, got {self.budget_bytes!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class RefitflowUpdateInfo:
    """One version: the newest complete publication at or above ``version`` is pulled and verified."""

    version: int
    timeout_s: float = 600.0  # the whole update on this worker: waiting for the version, pulling, the vote
    wait_s: float | None = None  # how long to wait for the version to be published (default: timeout_s)
    no_drain: bool = False  # shadow mode: prepare while the engine keeps generating, swap between two steps
    weight_version: str | None = None  # no_drain: the label from the swap on (default: the committed version)
    kv: str = "keep"  # no_drain, at the swap: keep the KV cache, reset the prefix cache, or recompute in flight
    adapter: str | None = None  # a LoRA adapter's name: land exactly ``version`` of it (docs/lora.md), not weights
    lora_root: str = LORA_ROOT  # adapter: where each worker writes it (vLLM's loader reads it from there)
    keep: int = 2  # adapter: its newest versions kept on disk (serve no older one: vLLM may reload from disk)
    catch_up_s: float | None = None  # a server joining a fleet: the version its peers relay, waiting this long for
    # them to relay the newest (REFITFLOW_JOIN sets it; docs/fleet.md)

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise ConfigError(f"version must be a non-negative integer, got {self.version!r}")
        if self.timeout_s <= 0 or (self.wait_s is not None and not 0 < self.wait_s <= self.timeout_s):
            raise ConfigError("timeout_s must be positive and wait_s between 0 and timeout_s")
        if self.kv not in KV_POLICIES:
            raise ConfigError(f"kv must be one of {KV_POLICIES}, got {self.kv!r}")
        if not isinstance(self.no_drain, bool):
            raise ConfigError(f"no_drain must be true or false, got {self.no_drain!r}")
        if self.adapter is not None and self.no_drain:
            raise ConfigError("an adapter update never drains: drop no_drain (it is for the base weights)")
        if self.catch_up_s is not None and (
            not 0 <= self.catch_up_s <= self.timeout_s or self.no_drain or self.adapter is not None
        ):
            raise ConfigError("catch_up_s is a plain update's wait (0 to timeout_s s): not with no_drain or adapter")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ConfigError(f"keep must be a positive number of adapter versions, got {self.keep!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

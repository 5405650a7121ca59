"""The ``refitflow`` backend's settings: verl's ``checkpoint_engine.engine_kwargs.refitflow`` (plain data).

verl hands every backend instance ``bucket_size`` (and ``is_master`` on the trainer side) plus the
mapping under ``engine_kwargs[<backend name>]``; this is that mapping, checked once, with a sentence
for every refusal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from refitflow.api.digesting import DIGEST_CHOICES
from refitflow.core.errors import ConfigError
from refitflow.core.types import Identity
from refitflow.integrations.hosting.info import RefitflowInitInfo

__all__ = ["VerlBackendConfig"]

# RefitflowInitInfo fields the backend fills in itself (the rest may come through ``vllm``)
_OWN_INIT = ("registry", "model", "identity")


@dataclass(frozen=True, kw_only=True)
class VerlBackendConfig:
    model: str  # the publication's identity: model name ...
    identity: Mapping[str, str] = field(default_factory=dict)  # ... and its other fields (layout, dtype, ...)
    registry: str | None = None  # a refitflow registry service's address; None: trainer rank 0 serves one
    registry_bind: str = "tcp://127.0.0.1:*"  # where trainer rank 0's registry binds (multi-node: the head's IP)
    digest: str = "auto"  # the publisher's digest algorithm (rf.Publisher's ``digest``)
    announce_early: bool | None = None  # two-phase publication (rf.Publisher's ``announce_early``; None: auto)
    publish_timeout_s: float = 600.0  # registering, digesting and announcing one version
    release_timeout_s: float = 600.0  # send_weights waits this long for every inference rank to be done
    init_timeout_s: float = 120.0  # opening the publisher (NIXL agent) or the registry
    replica_size: int = 1  # rollout workers per inference server (TP × DP × PP): the first of each drives it
    server_actor: str = "vllm_server_{replica}_0"  # the Ray actor of a replica's vLLM server (verl's name)
    update_timeout_s: float = 600.0  # one server's whole refit (waiting for the version, pulling, the vote)
    vllm: Mapping[str, Any] = field(default_factory=dict)  # more RefitflowInitInfo fields (mode, loader, vote, ...)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"engine_kwargs.refitflow.model must name the model, got {self.model!r}")
        try:
            self.full_identity  # noqa: B018 (built once to check the fields)
        except TypeError as exc:
            raise ConfigError(f"identity: {exc}; fields: layout, dtype, parallelism, compile_target") from exc
        if self.registry is not None and "://" not in self.registry:
            raise ConfigError(f"registry must be an address such as tcp://host:port, got {self.registry!r}")
        if self.digest not in DIGEST_CHOICES:
            raise ConfigError(f"digest must be one of {list(DIGEST_CHOICES)}, got {self.digest!r}")
        timeouts = (self.publish_timeout_s, self.release_timeout_s, self.init_timeout_s, self.update_timeout_s)
        if not all(isinstance(t, int | float) and t > 0 for t in timeouts):
            raise ConfigError("every *_timeout_s must be a positive number of seconds")
        if not isinstance(self.replica_size, int) or self.replica_size < 1:
            raise ConfigError(f"replica_size must be a positive integer (TP × DP × PP), got {self.replica_size!r}")
        own = sorted(set(self.vllm) & set(_OWN_INIT))
        if own:
            raise ConfigError(f"vllm may not set {own}: the backend sets them from model, identity and the registry")
        known = {f.name for f in fields(RefitflowInitInfo)}
        unknown = sorted(set(self.vllm) - known)
        if unknown:
            raise ConfigError(f"vllm: unknown init-info fields {unknown}; known: {sorted(known - set(_OWN_INIT))}")

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> VerlBackendConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"engine_kwargs.refitflow: unknown settings {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @property
    def full_identity(self) -> Identity:
        return Identity(model=self.model, **dict(self.identity))

    @property
    def vote_timeout_s(self) -> float:
        """How long the vLLM workers' engine vote may take after an update (their init info's)."""
        return float(self.vllm.get("vote_timeout_s", RefitflowInitInfo.vote_timeout_s))

    def init_info(self, registry: str) -> dict[str, Any]:
        """What every vLLM worker's refitflow backend is initialised with (checked as vLLM will)."""
        info = RefitflowInitInfo(registry=registry, model=self.model, identity=dict(self.identity), **dict(self.vllm))
        return info.to_dict()

"""``RefitflowEngine``: refitflow as a vLLM weight-transfer backend (``--weight-transfer-config
'{"backend": "refitflow"}'``), one per vLLM worker.

vLLM calls, on every worker, ``init_transfer_engine`` once, then per version ``start_weight_update``
→ ``update_weights`` → ``finish_weight_update``. Here:

- ``init_transfer_engine`` derives this worker's receiver layout (the layout tables at the worker's
  place, checked against its model's parameters) and opens a refitflow session: a loop thread, a
  preparer (a ``Receiver``, or the ``load_weights`` loader), an ``EngineMember`` and its vote channel;
- ``update_weights`` pulls, verifies and prepares the version, and runs the engine vote across the
  workers before it returns: on an ABORT verdict every worker raises (vLLM closes the update on
  each; in place the workers are fenced, shadow keeps the previous version); a worker that voted
  ready and could not learn the verdict raises too, saying it is in doubt;
- ``finish_weight_update`` makes the voted version visible (shadow: one device copy into the live
  storage; pointers never change, so captured CUDA graphs keep working), then derives the
  latent-attention weights of MLA models again (``mla``).

Voting inside ``update_weights`` (not in ``finish_weight_update``) keeps vLLM's worker state right:
vLLM closes an update whose ``update_weights`` raised, but keeps one whose ``finish`` raised open.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refitflow.core.errors import ConfigError, RefitError
from refitflow.core.types import Identity
from refitflow.integrations import vote_setup, writers
from refitflow.integrations.fused_model import parameters
from refitflow.integrations.rank_session import Build, RankSession, SessionConfig
from refitflow.integrations.vllm import mla
from refitflow.integrations.vllm.info import RefitflowInitInfo, RefitflowUpdateInfo
from refitflow.integrations.vllm.place import Place, receiver_layout

__all__ = ["RefitflowEngine"]

log = logging.getLogger(__name__)


class RefitflowEngine(WeightTransferEngine[RefitflowInitInfo, RefitflowUpdateInfo]):  # type: ignore[type-var, unused-ignore]
    init_info_cls = RefitflowInitInfo
    update_info_cls = RefitflowUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: RankSession | None = None
        self.loader: str | None = None  # "direct" or "load_weights", chosen at init
        self.place = Place.of(self.parallel_config)
        self.latent: set[str] = set()  # MLA weights derived after loading (re-derived after each commit)

    # -- vLLM's hooks --------------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: RefitflowInitInfo) -> None:
        if self.session is not None:
            raise ConfigError("the refitflow engine is already initialised: shut it down first")
        self.latent = mla.derived_parameters(self.model)
        if self.latent and not isinstance(self._dtype, torch.dtype):
            raise ConfigError("an MLA model needs vLLM's model_config.dtype to derive its attention weights")
        self.loader, build = self._writer(init_info)
        vote, addresses = self._vote(init_info)
        gloo = _gloo_group() if vote == "gloo" else None
        config = SessionConfig(
            registry=init_info.registry, identity=Identity(model=init_info.model, **init_info.identity),
            receiver_id=f"vllm-{init_info.model}-{self.place.name}", mode=init_info.mode,
            budget_bytes=init_info.budget_bytes, transport=init_info.transport, vote=vote,
            vote_rank=self.place.global_rank, vote_addresses=addresses, vote_timeout_s=init_info.vote_timeout_s,
            init_timeout_s=init_info.init_timeout_s, receiver_options=dict(init_info.receiver_options),
        )  # fmt: skip
        self.session = RankSession.open(config, build, gloo_group=gloo)
        log.info("refitflow: %s loader on %s, vote %s", self.loader, self.place.name, vote)

    def start_weight_update(self) -> None:
        self._open().drop_pending("a new update started before the last one was finished")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, receive (pull, verify, vote); no ``torch.accelerator.synchronize`` (fails without one)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RefitflowUpdateInfo) -> None:
        session = self._open()
        wait = update_info.wait_s if update_info.wait_s is not None else update_info.timeout_s
        session.update(update_info.version, timeout_s=update_info.timeout_s + session.config.vote_timeout_s,
                       wait_s=wait)  # fmt: skip

    def finish_weight_update(self) -> None:
        session = self._open()
        if session.commit() is not None and self.latent:
            self._rederive(session)

    def shutdown(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()

    # -- helpers -----------------------------------------------------------------------------------

    @property
    def status(self) -> dict[str, Any]:
        """This worker's refitflow state: loader, committed version, fence, first failure since the last commit."""
        return {"loader": self.loader, **(self.session.status if self.session else {})}

    @property
    def _dtype(self) -> Any:
        """The model's activation dtype (vLLM resolves ``model_config.dtype`` to a torch dtype)."""
        return getattr(self.model_config, "dtype", None)

    def _open(self) -> RankSession:
        if self.session is None:
            raise ConfigError("the refitflow engine is not initialised: call init_weight_transfer_engine first")
        return self.session

    def _writer(self, info: RefitflowInitInfo) -> tuple[str, Build]:
        """The direct writer when every parameter maps (``loader`` auto or direct), else load_weights."""
        params = [(n, p) for n, p in parameters(self.model) if n not in self.latent]
        return writers.choose(info.loader, params, lambda: receiver_layout(self.model_config, self.model, self.place),
                              self.model)  # fmt: skip

    def _rederive(self, session: RankSession) -> None:
        """The committed version's latent-attention weights, from its ``kv_b_proj``; a failure fences."""
        try:
            assert isinstance(self._dtype, torch.dtype)
            moved = mla.rederive(self.model, self._dtype)
            if moved:
                raise RefitError(f"vLLM re-derived {moved[:4]} into new storage: captured CUDA graphs read the old")
        except Exception as exc:
            reason = f"deriving the MLA attention weights after the commit failed: {type(exc).__name__}: {exc}"
            session.fence(reason)
            raise RefitError(reason) from exc

    def _vote(self, info: RefitflowInitInfo) -> tuple[str, tuple[str, ...]]:
        return vote_setup.plan(info.vote, info.vote_addresses, info.vote_host, self.place.vote_size, _world)


def _world() -> Any:
    """The CPU group spanning every worker: vLLM's world group, else torch.distributed's default one."""
    import torch.distributed as dist

    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().cpu_group
    except (AssertionError, ImportError):  # vLLM's groups are not set up (a worker outside vLLM)
        if dist.is_available() and dist.is_initialized():
            return None
    raise ConfigError("the engine vote needs vote_addresses: there is no torch.distributed group to exchange them")


def _gloo_group() -> Any:
    _world()  # a clear error when there is no group
    return vote_setup.gloo_group()  # our own: a failed vote must not break vLLM's groups

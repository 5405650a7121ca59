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

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from refitflow.api.receiver import Receiver
from refitflow.core.errors import ConfigError, RefitError
from refitflow.core.types import Identity
from refitflow.integrations.hosting import vote_setup, writers
from refitflow.integrations.hosting.fused_model import parameters
from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo
from refitflow.integrations.hosting.keys import deployment_keys
from refitflow.integrations.hosting.rank_session import RankSession, SessionConfig, process_id
from refitflow.integrations.vllm.weight_transfer import WeightTransferEngine
from refitflow.integrations.vllm.worker import kernels, mla
from refitflow.integrations.vllm.worker.lora import Landing
from refitflow.integrations.vllm.worker.place import Place, receiver_layout
from refitflow.integrations.vllm.worker.reload import LayerwiseLoad
from refitflow.integrations.vllm.worker.reprocessing import Reprocessing, reprocessing

__all__ = ["RefitflowEngine"]

log = logging.getLogger(__name__)


class RefitflowEngine(WeightTransferEngine[RefitflowInitInfo, RefitflowUpdateInfo]):  # type: ignore[type-var, unused-ignore]
    init_info_cls = RefitflowInitInfo
    update_info_cls = RefitflowUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: RankSession | None = None
        self.landing: Landing | None = None  # LoRA adapter versions (lora.py)
        self.loader: str | None = None  # "direct" or "load_weights", chosen at init
        self.why = ""  # why that loader
        self.mode = "in_place"
        self.place = Place.of(self.parallel_config)
        self.latent: set[str] = set()  # MLA weights derived after loading (re-derived after each commit)
        self.split: kernels.Split | None = None  # per layer: written directly, or reprocessed (kernels.py)
        self.watch: kernels.StorageWatch | None = None  # every tensor's storage, checked after each commit

    # -- vLLM's hooks --------------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: RefitflowInitInfo) -> None:
        if self.session is not None:
            raise ConfigError("the refitflow engine is already initialised: shut it down first")
        self.latent = mla.derived_parameters(self.model)
        if self.latent and not isinstance(self._dtype, torch.dtype):
            raise ConfigError("an MLA model needs vLLM's model_config.dtype to derive its attention weights")
        self.loader, build, self.why = self._writer(init_info)
        self.mode = init_info.mode
        vote, addresses = self._vote(init_info)
        gloo = _gloo_group() if vote == "gloo" else None
        config = SessionConfig(
            registry=init_info.registry, identity=Identity(model=init_info.model, **init_info.identity),
            receiver_id=process_id("vllm", init_info.model, self.place.name), mode=init_info.mode,
            shadow_commit=init_info.shadow_commit,
            budget_bytes=init_info.budget_bytes, transport=init_info.transport, vote=vote,
            vote_rank=self.place.global_rank, vote_addresses=addresses, vote_timeout_s=init_info.vote_timeout_s,
            init_timeout_s=init_info.init_timeout_s, receiver_options=dict(init_info.receiver_options),
            keys=deployment_keys("rollout"),
        )  # fmt: skip
        self.session = RankSession.open(config, build, gloo_group=gloo)
        self.landing = Landing(self.session, registry=init_info.registry, transport=init_info.transport,
                               receiver_id=f"{config.receiver_id}-lora")  # fmt: skip
        self.watch = kernels.StorageWatch(self.model)
        log.info("refitflow: %s loader on %s, vote %s, mode %s", self.loader, self.place.name, vote, init_info.mode)

    def start_weight_update(self) -> None:
        self._open().drop_pending("a new update started before the last one was finished")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, receive (pull, verify, vote); no ``torch.accelerator.synchronize`` (fails without one)."""
        with self._explained("update"):
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RefitflowUpdateInfo) -> None:
        session = self._open()
        wait = update_info.wait_s if update_info.wait_s is not None else update_info.timeout_s
        timeout = update_info.timeout_s + session.config.vote_timeout_s
        if update_info.catch_up_s is not None:  # joining a fleet: the version its peers hold
            version = max(session.catch_up_version(wait_s=update_info.catch_up_s), update_info.version)
            session.update(version, timeout_s=timeout, wait_s=wait)
            return
        if not update_info.no_drain:
            session.update(update_info.version, timeout_s=timeout, wait_s=wait)
            return
        if self.mode != "shadow":
            raise ConfigError("no_drain needs mode='shadow': the engine keeps serving the live weights while the "
                              "next version fills the shadow")  # fmt: skip
        session.begin_update(update_info.version, timeout_s=timeout, wait_s=wait)  # returns at once

    def drain_state(self) -> dict[str, Any]:
        """A no-drain update's progress (``nodrain.worker_state`` reads it between two steps)."""
        phase, error = self._open().poll_update()
        if error is not None:
            phase, error = "failed", self._explain("update", error)
        pending = self._open().pending
        return {"phase": phase, "error": error, "version": None if pending is None else pending.version}

    def begin_adapter(self, update_info: dict[str, Any]) -> None:
        """Start landing a LoRA adapter version (``update_info.adapter``); the engine core polls ``adapter_state``."""
        with self._explained("adapter update"):
            info = self.parse_update_info(update_info)
            if info.adapter is None:
                raise ConfigError("begin_adapter needs update_info.adapter")
            self._landing().begin(info)

    def adapter_state(self) -> dict[str, Any]:
        state = self._landing().state()
        if state["error"] is not None:
            state["error"] = self._explain("adapter update", state["error"])
        return state

    def finish_weight_update(self) -> None:
        with self._explained("finish"):
            session = self._open()
            if session.commit() is not None:
                self._after_commit(session)

    @contextlib.contextmanager
    def _explained(self, hook: str) -> Iterator[None]:
        """A failure as vLLM shows it (HTTP 500 body, server log): which loader and why, the mode, the root
        cause with its type, and what this worker serves now. Typed errors keep their type."""
        try:
            yield
        except Exception as exc:
            message = self._explain(hook, f"{type(exc).__name__}: {exc}")
            log.error("%s", message)
            if isinstance(exc, RefitError):
                exc.args = (message,)
                raise
            raise RefitError(message) from exc

    def _explain(self, hook: str, error: str) -> str:
        fence = self.gate_status()
        now = ("refuses every request (fenced) until a later version commits" if fence["fence"] == "fenced"
               else f"serves version {fence['committed_version']}" if fence["committed_version"] is not None
               else "serves the weights it loaded")  # fmt: skip
        return (f"refitflow {hook} on {self.place.name} failed: {error} [{self.loader} loader ({self.why}), mode "
                f"{self.mode}; this worker {now}]")  # fmt: skip

    def shutdown(self) -> None:
        session, self.session = self.session, None
        landing, self.landing = self.landing, None
        if landing is not None:
            landing.close()
        if session is not None:
            session.close()

    # -- helpers -----------------------------------------------------------------------------------

    @property
    def status(self) -> dict[str, Any]:
        """This worker's refitflow state: loader, committed version, fence, first failure since the last commit."""
        return {"loader": self.loader, **(self.session.status if self.session else {})}

    def gate_status(self) -> dict[str, Any]:
        """What the serving gate reads (``gate.worker_fence``): this worker's fence and why it is closed."""
        status = self.session.status if self.session else {}
        return {"fence": status.get("fence", "ready"), "reason": status.get("fence_reason"),
                "committed_version": status.get("committed_version"), "open": self.session is not None,
                **{k: status.get(k, 0) for k in ("pulled_bytes", "relay_bytes", "rerouted_bytes")}}  # fmt: skip

    @property
    def _dtype(self) -> Any:
        """The model's activation dtype (vLLM resolves ``model_config.dtype`` to a torch dtype)."""
        return getattr(self.model_config, "dtype", None)

    def _landing(self) -> Landing:
        self._open()
        assert self.landing is not None
        return self.landing

    def _open(self) -> RankSession:
        if self.session is None:
            raise ConfigError("the refitflow engine is not initialised: call init_weight_transfer_engine first")
        return self.session

    def _writer(self, info: RefitflowInitInfo) -> writers.Choice:
        """The direct writer (live parameters the kernels read, and reprocessed layers' loading layouts) when
        every one maps (``loader`` auto or direct), else load_weights. Logs which layers take which path."""
        self.split = split = kernels.split(self.model)
        log.info("refitflow on %s: %s", self.place.name, split.summary())
        if split.layers:
            kinds = sorted({layer.method for layer in split.layers})
            self.why = f"{len(split.layers)} layers ({', '.join(kinds)}) reprocessed through vLLM's reload steps"
        params = [(n, p) for n, p in split.targets() if n not in self.latent]
        unloadable = "; ".join(f"{n}: {w}" for n, w in split.unloadable.items())
        layout = lambda: receiver_layout(self.model_config, self.model, self.place)  # noqa: E731
        live = [(n, p) for n, p in parameters(self.model) if n not in self.latent]
        # load_weights inside vLLM's layerwise reload when vLLM recorded the loading layout (its own loader did)
        load = LayerwiseLoad(self.model, self.model_config, restore=info.mode == "shadow") if kernels.recorded(
            self.model) else None  # fmt: skip
        choice = writers.choose(info.loader, params, layout, self.model, live=live, load=load, refused=unloadable)
        if choice.loader != "direct" or not split.layers:
            return choice
        return choice._replace(build=reprocessing(choice.build, split.layers), why=f"{choice.why}; {self.why}")

    def _after_commit(self, session: RankSession) -> None:
        """Derive MLA weights, then check that every tensor the kernels read is still the storage written; any
        failure fences this worker. (Transformed layers were processed before the vote and installed with the
        commit: ``reprocessing``.)"""
        step = "deriving the MLA attention weights"
        try:
            if self.latent:
                assert isinstance(self._dtype, torch.dtype)
                mla.rederive(self.model, self._dtype)
            step = "checking the storage the kernels read"
            receiver = getattr(session.member, "receiver", None) if session.member is not None else None
            swapped = None  # where a shadow swap moved the model's own parameters (not reprocessed layers' staging)
            receiver = receiver.inner if isinstance(receiver, Reprocessing) else receiver
            if isinstance(receiver, Receiver) and self.split is not None:
                own = {n for n, _ in self.split.direct}
                swapped = {n: ptr for n, ptr in receiver.destination.live_pointers().items() if n in own}
            moved = self.watch.moved(swapped) if self.watch is not None else []
            if moved:
                raise RefitError(f"{len(moved)} tensors no longer sit where they did, e.g. {moved[:4]}: the model "
                                 "(and any captured CUDA graph) may read storage refitflow did not write")  # fmt: skip
        except Exception as exc:
            reason = f"version committed, then {step} failed: {type(exc).__name__}: {exc}"
            log.error("refitflow on %s: %s; this worker is fenced until a later version commits", self.place.name,
                      reason, exc_info=not isinstance(exc, RefitError))  # fmt: skip
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

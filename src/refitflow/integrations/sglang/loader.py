"""``refit``: refitflow as SGLang's custom weight loader (``--custom-weight-loader
refitflow.integrations.sglang.loader.refit``), run by every scheduler (one per TP rank) inside
``/update_weights_from_tensor`` with that path as ``load_format``.

On its first call a worker opens its refitflow session over the live model: the receiver layout
from the tables at its place (or the model's ``load_weights`` when the model does not map), a
preparer registered with the trainer's registry, and the engine vote across the server's ranks
(``SoloVote``, ``ZmqVote`` with addresses exchanged over SGLang's world group, or ``GlooVote``).
Each call then pulls, verifies and prepares the version, votes, and — the engine having decided
COMMIT — makes it visible (in place: opens the fence; shadow: copies the verified shadow into the
live storage), then runs the model's own ``post_load_weights`` when it has one (what SGLang's loaders
run after loading; ``end_weight_update`` skips it after a custom load).

SGLang answers an update with its TP rank 0's result alone, so every rank ends ``refit`` by exchanging
its outcome with the others (``answers.settle``): each rank raises if any rank did not commit, saying which
and how it was left, and whether the server may serve. Failures raise typed ``RefitError``s. SGLang stops
its scheduler on any exception from a loader, so
``refit`` runs only under the guard of the refitflow SGLang plugin (``plugin.guard``), which turns
them into SGLang's ``(False, message)`` answer; without it ``refit`` refuses to run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from refitflow.core.errors import ConfigError, RefitError
from refitflow.core.types import Identity
from refitflow.integrations.hosting import vote_setup, writers
from refitflow.integrations.hosting.fused_model import parameters
from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo
from refitflow.integrations.hosting.keys import deployment_keys
from refitflow.integrations.hosting.rank_session import RankSession, SessionConfig, process_id
from refitflow.integrations.sglang import answers, payload
from refitflow.integrations.sglang.place import Place, receiver_layout

__all__ = ["Worker", "guarded", "refit", "workers"]

log = logging.getLogger(__name__)

_guard = threading.local()
_workers: dict[int, Worker] = {}  # id(model) -> its session: one model per scheduler (selector "target")
_plans: dict[int, tuple[RefitflowInitInfo, tuple[str, tuple[str, ...], Any]]] = {}  # id(model) -> its vote


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Mark this thread's call as running under the plugin's guard (``plugin.guard``)."""
    before = getattr(_guard, "active", False)
    _guard.active = True
    try:
        yield
    finally:
        _guard.active = before


def refit(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader: refit ``model`` to the version ``named_tensors`` names (``payload``)."""
    if not getattr(_guard, "active", False):
        raise ConfigError(
            "refitflow's SGLang loader runs only under its plugin's guard: the 'sglang.srt.plugins' entry point "
            "'refitflow' was not loaded in this scheduler (is refitflow installed in SGLang's environment, and "
            "'refitflow' in SGLANG_PLUGINS if that is set?)"
        )
    failure: Exception | None = None
    try:
        init, update = payload.decode(named_tensors)
        worker = _workers.get(id(model))
        if worker is not None and worker.init != init:
            log.warning("refitflow: the init info changed; closing this worker's session and opening a new one")
            _workers.pop(id(model)).close()
            worker = None
        if worker is None:
            worker = _workers[id(model)] = Worker.open(model, init, Place.current())
        worker.refit(update)
    except Exception as exc:  # every rank still answers: SGLang's reply is TP rank 0's alone
        failure = exc
    answers.settle(_mine(model, failure), failure)


def _mine(model: torch.nn.Module, failure: Exception | None) -> answers.Answer:
    worker = _workers.get(id(model))
    status = worker.session.status if worker is not None else {}
    rank = worker.place.rank if worker is not None else answers.world_rank()
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    return answers.Answer(rank=rank, error=error, fence=status.get("fence"), version=status.get("committed_version"))


def workers() -> dict[int, Worker]:
    """This process's open sessions (by ``id(model)``)."""
    return dict(_workers)


@dataclass(kw_only=True)
class Worker:
    """One scheduler's refitflow session over its live model."""

    model: torch.nn.Module
    init: RefitflowInitInfo
    place: Place
    loader: str
    session: RankSession
    pointers: dict[str, int]

    @classmethod
    def open(cls, model: torch.nn.Module, init: RefitflowInitInfo, place: Place) -> Worker:
        vote, addresses, gloo = _vote_plan(model, init, place)
        params = parameters(model)
        loader, build, _ = writers.choose(init.loader, params, lambda: receiver_layout(model, place), model)
        config = SessionConfig(
            registry=init.registry, identity=Identity(model=init.model, **init.identity),
            receiver_id=process_id("sglang", init.model, place.name), mode=init.mode, budget_bytes=init.budget_bytes,
            transport=init.transport, vote=vote, vote_rank=place.rank, vote_addresses=addresses,
            vote_timeout_s=init.vote_timeout_s, init_timeout_s=init.init_timeout_s,
            receiver_options=dict(init.receiver_options), keys=deployment_keys("rollout"),
        )  # fmt: skip
        session = RankSession.open(config, build, gloo_group=gloo)
        log.info("refitflow: %s loader on %s, vote %s", loader, place.name, vote)
        return cls(model=model, init=init, place=place, loader=loader, session=session, pointers=_pointers(model))

    def refit(self, update: RefitflowUpdateInfo) -> int | None:
        """Pull, verify, vote, commit; the version committed. Raises unless every rank commits."""
        moved = [n for n, p in _pointers(self.model).items() if self.pointers.get(n) != p]
        if moved:  # e.g. a quantisation method that repacks into new storage at end_weight_update
            raise ConfigError(f"parameters {moved[:4]} moved to new storage since the session opened: refitflow "
                              "writes the storage it mapped, so this model cannot be refitted in place")  # fmt: skip
        wait = update.wait_s if update.wait_s is not None else update.timeout_s
        self.session.update(update.version, timeout_s=update.timeout_s + self.init.vote_timeout_s, wait_s=wait)
        version = self.session.commit()
        post_load = getattr(self.model, "post_load_weights", None)
        if version is not None and callable(post_load):
            try:
                post_load()
            except Exception as exc:
                reason = f"the model's post_load_weights failed after version {version} committed: {exc!r}"
                self.session.fence(reason)
                raise RefitError(reason, version=version) from exc
        return version

    @property
    def status(self) -> dict[str, Any]:
        return {"loader": self.loader, **self.session.status}

    def close(self) -> None:
        self.session.close()


def _pointers(model: torch.nn.Module) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in parameters(model)}


def _vote_plan(model: torch.nn.Module, init: RefitflowInitInfo, place: Place) -> tuple[str, tuple[str, ...], Any]:
    """The vote, its ZMQ addresses and gloo group, made once per init info: exchanging addresses and making a
    group are collectives every rank must reach together, so a rank that retries opening its session after
    a failure (its peers opened theirs) reuses them instead of waiting alone in a collective."""
    cached = _plans.get(id(model))
    if cached is not None and cached[0] == init:
        return cached[1]
    vote, addresses = vote_setup.plan(init.vote, init.vote_addresses, init.vote_host, place.size, _world)
    plan = (vote, addresses, vote_setup.gloo_group() if vote == "gloo" else None)
    _plans[id(model)] = (init, plan)
    return plan


def _world() -> Any:
    """The CPU group of every rank of this server: SGLang's world group, else torch.distributed's default."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().world_group.cpu_group
    except (AttributeError, RuntimeError, ValueError, ImportError):  # SGLang's groups are not built
        return None

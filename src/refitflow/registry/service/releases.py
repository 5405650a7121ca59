"""Receivers and releases in the in-memory store (``RegistryStore``'s half that counts who is done).

Receivers register, and report each version they are done with (committed, aborted or skipped); a version
is *released* per a :class:`ReleasePolicy` (default: every registered receiver is done with it), and
dropped once released and superseded by a newer complete version (``_collect``, oldest first). After a
restart the store cannot know the receivers that have not re-registered yet: ``hold_releases`` withholds
"every receiver is done" for a while (the service calls it when a client of an earlier incarnation returns).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from refitflow.core.errors import RefitTimeoutError
from refitflow.core.types import Identity
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.service.leases import Key
from refitflow.registry.service.model import Model

__all__ = ["Releasing"]

_DEFAULT_POLICY = ReleasePolicy()


class Releasing:
    """Set up by ``RegistryStore``: its models, clock, change event and owners."""

    _clock: Callable[[], float]
    _changed: anyio.Event
    _hold_until: float

    _model: Callable[[Identity], Model]  # what is held of an identity (made if new)
    _peek: Callable[[Identity], Model]  # ... (an empty model if unknown)
    _own: Callable[[str | None, Key], None]
    _notify: Callable[[], None]
    _drop_relays: Callable[[Model, str], None]  # (``relay_joins``)

    async def register_receiver(self, identity: Identity, receiver_id: str, *, owner: str | None = None) -> None:
        self._model(identity).receivers.setdefault(receiver_id, -1)
        self._own(owner, (identity, receiver_id, -1))
        self._notify()

    async def unregister_receiver(self, identity: Identity, receiver_id: str) -> None:
        model = self._peek(identity)
        model.receivers.pop(receiver_id, None)
        model.upstream.pop(receiver_id, None)
        self._drop_relays(model, receiver_id)
        self._collect(model)
        self._notify()

    async def report(self, identity: Identity, receiver_id: str, version: int) -> None:
        """A receiver is done with ``version`` (and so with every older one)."""
        model = self._peek(identity)
        if receiver_id in model.receivers:
            model.receivers[receiver_id] = max(model.receivers[receiver_id], version)
        self._collect(model)
        self._notify()

    def hold_releases(self, seconds: float) -> None:
        """For ``seconds``, "every registered receiver is done" releases nothing: receivers of an earlier
        incarnation of this registry may not have re-registered yet (a count or a time still releases)."""
        self._hold_until = max(self._hold_until, self._clock() + seconds)
        self._notify()

    def _released(self, model: Model, version: int, policy: ReleasePolicy = _DEFAULT_POLICY) -> bool:
        done_at = model.completed_at.get(version)
        age = None if done_at is None else self._clock() - done_at
        return policy.released(model.receivers.values(), version, age, all_known=self._clock() >= self._hold_until)

    async def is_released(self, identity: Identity, version: int, *, policy: ReleasePolicy | None = None) -> bool:
        return self._released(self._peek(identity), version, policy or _DEFAULT_POLICY)

    async def acked(self, identity: Identity, version: int) -> tuple[int, int]:
        """(receivers done with ``version``, receivers registered)."""
        receivers = self._peek(identity).receivers
        return sum(done >= version for done in receivers.values()), len(receivers)

    async def wait_released(
        self, identity: Identity, version: int, timeout: float | None, *, policy: ReleasePolicy | None = None
    ) -> None:
        """Return once ``version`` is released per ``policy`` (default: every registered receiver is done)."""
        policy = policy or _DEFAULT_POLICY
        with anyio.move_on_after(timeout):
            while True:
                changed = self._changed
                model = self._peek(identity)
                if self._released(model, version, policy):
                    return
                now, wakes = self._clock(), []
                if policy.after_s is not None and version in model.completed_at:
                    wakes.append(model.completed_at[version] + policy.after_s - now)
                if self._hold_until > now:
                    wakes.append(self._hold_until - now)
                with anyio.move_on_after(max(0.0, min(wakes)) + 1e-3 if wakes else None):
                    await changed.wait()
        raise RefitTimeoutError(f"version not released within {timeout} s", version=version)

    def _collect(self, model: Model) -> int:
        """Drop versions that are released and superseded by a newer complete version, oldest first
        (under the default policy a version is released only if every older one is); how many."""
        newest, dropped = model.newest, 0
        while newest is not None and model.order and model.order[0] < newest and self._released(model, model.order[0]):
            model.drop(model.order[0])
            dropped += 1
        return dropped


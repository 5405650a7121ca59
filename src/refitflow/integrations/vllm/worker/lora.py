"""A vLLM worker's side of a LoRA refit: land an adapter version where vLLM's own LoRA loader reads it.

The engine core starts it on every worker (``nodrain.begin`` with ``update_info.adapter``) and goes on
stepping; each worker pulls the whole adapter on its refitflow loop thread (``lora.AdapterReceiver``:
verified, the base version checked against the one this worker serves) and writes it under
``<lora_root>/<adapter>@v<version>``. The core answers ``update_weights`` once every worker landed it, or
with the first failure; only then does the driver name it to vLLM (``/v1/load_lora_adapter``), so a
version some worker could not land is never served. vLLM's start/finish are not used: its
``finish_weight_update`` drops every loaded adapter (``reset_lora_state``).
"""

from __future__ import annotations

import concurrent.futures
import pathlib
from typing import Any

from refitflow.integrations.hosting.info import RefitflowUpdateInfo
from refitflow.integrations.hosting.rank_session import RankSession
from refitflow.integrations.lora import AdapterReceiver, Landed

__all__ = ["Landing"]


class Landing:
    """One worker's adapter updates, one at a time, on its session's loop thread."""

    def __init__(self, session: RankSession, *, registry: str, transport: str, receiver_id: str) -> None:
        self.session = session
        self._args: dict[str, Any] = {"registry": registry, "transport": transport, "receiver_id": receiver_id,
                      "security": session.config.security}  # fmt: skip
        self._receiver: AdapterReceiver | None = None  # made on the loop thread at the first adapter
        self._job: concurrent.futures.Future[Landed] | None = None
        self.last: Landed | None = None

    def begin(self, info: RefitflowUpdateInfo) -> None:
        """Start landing ``info.adapter`` version ``info.version``; returns at once (``state`` says how it went)."""
        if self._job is not None and not self._job.done():
            raise RuntimeError("refitflow: an adapter update is already in flight on this worker")
        served = self.session.status.get("committed_version") or 0  # 0: the checkpoint vLLM booted from
        self._job = self.session.loop.start(self._land, info, int(served), timeout=info.timeout_s,
                                            what=f"landing adapter {info.adapter} version {info.version}")  # fmt: skip

    async def _land(self, info: RefitflowUpdateInfo, served: int) -> Landed:
        if self._receiver is None:
            self._receiver = AdapterReceiver(**self._args)
        assert info.adapter is not None
        self.last = await self._receiver.receive(info.adapter, info.version, base_version=served,
                                                 root=pathlib.Path(info.lora_root), keep=info.keep,
                                                 timeout=info.wait_s or info.timeout_s)  # fmt: skip
        return self.last

    def state(self) -> dict[str, Any]:
        """``{"phase": "preparing" | "prepared" | "failed", "error", "version"}`` (what the engine core polls)."""
        job = self._job
        if job is None or not job.done():
            return {"phase": "preparing" if job is not None else "idle", "error": None, "version": None}
        error = job.exception()
        if error is not None:
            return {"phase": "failed", "error": f"{type(error).__name__}: {error}", "version": None}
        return {"phase": "prepared", "error": None, "version": job.result().version}

    def close(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            self.session.loop.run(receiver.aclose, timeout=30.0, what="closing the adapter receiver")

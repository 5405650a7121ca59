"""The soak's registry service: one process in memory, or replicas on an etcd cluster (``bench/soak.py``).

On etcd the service has three *slots* (addresses, each with its announcement address); two hold a live replica
at the start of each version and every client is given all three (``address``). ``kill_oldest`` SIGKILLs the
replica that has lived longest — the one every client uses, since clients move only when theirs stops
answering — and nothing restarts it during that version; ``refill`` starts a new replica in an empty slot
before the next one (the dead slot is filled again two versions later: a new process, a new start).
``restart`` kills every replica and starts each again on its address (the matrix's ``registry_restart``).
"""

from __future__ import annotations

import socket

from anyio.abc import TaskGroup

from bench._soak_child import Child

__all__ = ["Registries"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registries:
    def __init__(self, store: str) -> None:
        self.store = store  # "memory", or an etcd URL
        self.slots = [(f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}")
                      for _ in range(1 if store == "memory" else 3)]  # fmt: skip
        self.live: list[Child | None] = [None] * len(self.slots)
        self.born: list[int] = [0] * len(self.slots)  # when each slot's replica started (a counter)
        self._starts = 0
        self.all: list[Child] = []  # every replica started (for the leak count)
        self._measured = True  # slot 0 never lost its replica for good (a restart keeps it: as before replicas)

    @property
    def address(self) -> str:
        return ",".join(a for a, _ in self.slots)

    async def _start(self, tg: TaskGroup, slot: int) -> None:
        address, pub = self.slots[slot]
        child = Child("registry", address, pub, self.store)
        await child.start(tg)
        self._starts += 1
        self.live[slot], self.born[slot] = child, self._starts
        self.all.append(child)

    @property
    def first(self) -> Child | None:
        """The registry whose fds and RSS the run follows: slot 0's (restarted or not), unless a replica kill took
        it for good (then None)."""
        return self.live[0] if self._measured else None

    async def start(self, tg: TaskGroup) -> None:
        for slot in range(min(2, len(self.slots))):
            await self._start(tg, slot)

    async def kill_oldest(self) -> None:
        alive = [s for s, c in enumerate(self.live) if c is not None]
        slot = min(alive, key=lambda s: self.born[s])
        child = self.live[slot]
        assert child is not None
        await child.kill()
        self._vacate(slot)

    def _vacate(self, slot: int) -> None:
        """``slot``'s replica is gone for good (``refill`` starts another there); slot 0's ends the fds and RSS
        followed."""
        self.live[slot] = None
        self._measured = self._measured and slot != 0

    def crashed(self) -> list[str]:
        """The replicas that exited by themselves since the last call (``Child.crashed``); their slots are emptied
        for ``refill``."""
        out = []
        for slot, child in enumerate(self.live):
            if child is not None and (how := child.crashed()) is not None:
                out.append(how)
                self._vacate(slot)
        return out

    async def refill(self, tg: TaskGroup) -> None:
        """Two live replicas again (a new one in an empty slot)."""
        while sum(c is not None for c in self.live) < min(2, len(self.slots)):
            empty = [s for s, c in enumerate(self.live) if c is None]
            await self._start(tg, min(empty, key=lambda s: self.born[s]))  # the one empty the longest

    async def restart(self, tg: TaskGroup) -> None:
        slots = [s for s, c in enumerate(self.live) if c is not None]
        for slot in slots:
            child = self.live[slot]
            assert child is not None
            await child.kill()
        for slot in slots:
            await self._start(tg, slot)

    async def kill(self) -> None:
        for child in self.live:
            if child is not None:
                await child.kill()

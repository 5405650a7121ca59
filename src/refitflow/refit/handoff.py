"""Handing buckets from stage to stage, and a failure out of a stage's tasks.

``channel``/``take``/``give``: a bounded FIFO between two stages (one task sends, one receives: the pipeline's
shape), made for the cost of a bucket. anyio's memory object streams yield to the event loop before every
``send`` and ``receive``, make an ``Event`` and look up the current task for every wait, and check the
receiver's cancellation for every item: about 40 µs of a bucket's 110 in a pipeline of eight stages, measured
with ``bench/bucket_cost.py``. Here an item passes at once when the channel has it or room for it; a stage waits
(an asyncio future; an ``anyio.Event`` on another backend) only when its input is empty or its output full, so a
stage still yields whenever it waits and no stage keeps the loop for long (the channels are bounded). The
semantics are the streams' as the stages use them: ``size`` 0 hands over (the sender waits until the item is
taken); a sending end closed is the end of input (``take`` returns None once the items are taken), but one left
by an exception (a failure, a cancellation) breaks the receiver: a stage after a failed one never mistakes the
failure for the end of its input, however the cancellation reaches the two; a receiving end closed breaks the
sender. Broken, either side gets ``anyio.BrokenResourceError``: an echo ``first_error`` passes over. An item
handed over stays handed over: a sender cancelled while it waits for room does not withdraw it (every stage is
cancelled with it).

``first_error``: the error a task group of stages (or of one stage's tasks) failed with, not its echoes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Generic, NoReturn, Self, TypeVar

import anyio
import anyio.lowlevel
import sniffio

__all__ = ["Receiving", "Sending", "channel", "first_error", "give", "take"]

T = TypeVar("T")


class _State(Generic[T]):
    __slots__ = ("broken", "items", "loop", "receiver", "receiver_closed", "sender", "sender_closed", "size")

    def __init__(self, size: int) -> None:
        self.items: deque[T] = deque()
        self.size = size
        self.sender: Any = None  # the waiting sender's future (or anyio Event)
        self.receiver: Any = None  # the waiting receiver's
        self.sender_closed = self.receiver_closed = False
        self.broken = False  # the sender left with an exception
        self.loop = asyncio.get_running_loop() if sniffio.current_async_library() == "asyncio" else None

    async def wait(self, side: str) -> None:
        """Wait until the other side wakes this one (``side``: "sender" or "receiver")."""
        waiter: Any = self.loop.create_future() if self.loop is not None else anyio.Event()
        setattr(self, side, waiter)
        try:
            await (waiter if self.loop is not None else waiter.wait())
        finally:
            setattr(self, side, None)

    @staticmethod
    def wake(waiter: Any) -> None:
        if waiter is None:
            return
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_result(None)
        else:
            waiter.set()


class _End(Generic[T]):
    __slots__ = ("_st",)

    def __init__(self, st: _State[T]) -> None:
        self._st = st

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Left by an exception."""
        self.close()

    def statistics(self) -> tuple[int, int]:
        """(items in the channel, its size)."""
        return len(self._st.items), self._st.size


class Sending(_End[T]):
    """The sending end of a ``channel``: closing it ends the receiver's input."""

    def close(self) -> None:
        self._st.sender_closed = True
        self._st.wake(self._st.receiver)

    def abort(self) -> None:
        self._st.broken = True
        self.close()


class Receiving(_End[T]):
    """The receiving end of a ``channel``: closing it breaks the sender's next ``give``."""

    def close(self) -> None:
        self._st.receiver_closed = True
        self._st.wake(self._st.sender)


async def _broken() -> NoReturn:
    """The other side left with an exception, or closed: cancelled beside it (as it was, most likely), be
    cancelled, not broken."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    raise anyio.BrokenResourceError


def channel(size: int) -> tuple[Sending[T], Receiving[T]]:
    """A channel holding up to ``size`` items (0: each handed over), made in the event loop that will use it."""
    st: _State[T] = _State(size)
    return Sending(st), Receiving(st)


async def take(receive: Receiving[T]) -> T | None:
    """The next item, or None at the end of input (the sending side closed and every item was taken);
    ``anyio.BrokenResourceError`` if the sending side failed."""
    st = receive._st
    while not st.items or st.broken:
        if st.broken:
            await _broken()
        if st.sender_closed:
            return None
        if st.receiver_closed:
            raise anyio.ClosedResourceError
        await st.wait("receiver")
    item = st.items.popleft()
    if len(st.items) <= st.size:
        st.wake(st.sender)
    return item


async def give(send: Sending[T], item: T) -> None:
    """Hand ``item`` on, waiting only while the channel is full (``anyio.BrokenResourceError``: the receiver
    closed its end)."""
    st = send._st
    if st.receiver_closed:
        await _broken()
    if st.sender_closed:
        raise anyio.ClosedResourceError
    st.items.append(item)
    st.wake(st.receiver)
    while len(st.items) > st.size:
        await st.wait("sender")
        if st.receiver_closed:
            await _broken()


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error in a task group's exceptions: cancellations, and a stream broken under a task because
    the task beside it failed, are echoes of it."""
    echoes = (anyio.get_cancelled_exc_class(), anyio.BrokenResourceError)
    found = [first_error(e) if isinstance(e, BaseExceptionGroup) else e for e in group.exceptions]
    return next((e for e in found if not isinstance(e, echoes)), found[0])

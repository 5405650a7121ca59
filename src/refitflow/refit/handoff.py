"""Handing buckets from stage to stage, and a failure out of a stage's tasks.

``take``/``give``: without a trip round the event loop when none is needed.

anyio's ``send`` and ``receive`` on a memory object stream first yield to the event loop (a checkpoint), even
when the item could pass at once: two trips a handoff, about 10 µs each in a pipeline of eight stages (a
quarter of what a small bucket cost a refit). ``take`` and ``give`` pass the item at once when the stream has it
or room for it, and wait (with the checkpoint) only when it does not. A stage still yields whenever it waits:
its input runs dry or its output fills (the streams are bounded), so no stage keeps the loop for long.

``first_error``: the error a task group of stages (or of one stage's tasks) failed with, not its echoes.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio import EndOfStream, WouldBlock
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["first_error", "give", "take"]

T = TypeVar("T")


async def take(receive: MemoryObjectReceiveStream[T]) -> T | None:
    """The next item, or None at the end of the stream (the sending side closed)."""
    try:
        return receive.receive_nowait()
    except WouldBlock:
        pass
    except EndOfStream:
        return None
    try:
        return await receive.receive()
    except EndOfStream:
        return None


async def give(send: MemoryObjectSendStream[T], item: T) -> None:
    """Hand ``item`` on, waiting only while the stream is full."""
    try:
        send.send_nowait(item)
    except WouldBlock:
        await send.send(item)


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error in a task group's exceptions: cancellations, and a stream broken under a task because
    the task beside it failed, are echoes of it."""
    echoes = (anyio.get_cancelled_exc_class(), anyio.BrokenResourceError)
    found = [first_error(e) if isinstance(e, BaseExceptionGroup) else e for e in group.exceptions]
    return next((e for e in found if not isinstance(e, echoes)), found[0])

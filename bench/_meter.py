"""What the benches count of processes: a process's CPU seconds (``cpu_seconds``; its live threads', to the
nanosecond: ``thread_cpu_seconds``), and every byte this process's asyncio ZMQ sockets send and receive
(``count_zmq_bytes``, into ``MOVED[0]``)."""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any

MOVED = [0]  # bytes on this process's asyncio ZMQ sockets (sent and received), once count_zmq_bytes() ran


def cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by process ``pid``."""
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of the threads process ``pid`` runs now, in nanoseconds' resolution (``/proc``'s schedstat;
    ``cpu_seconds`` counts whole ticks, 10 ms, too coarse for one refit's, but also threads that ended)."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def count_zmq_bytes() -> None:
    """Count every frame this process's asyncio ZMQ sockets send and receive (the registry's traffic, seen from
    its peers: the same figure for any refitflow tree)."""
    import zmq.asyncio

    send, recv = zmq.asyncio.Socket.send, zmq.asyncio.Socket.recv_multipart

    def counted_send(self: Any, data: Any, *a: Any, **kw: Any) -> Any:
        MOVED[0] += len(data)
        return send(self, data, *a, **kw)

    async def counted_recv(self: Any, *a: Any, **kw: Any) -> Any:
        frames = await recv(self, *a, **kw)
        MOVED[0] += sum(len(f) for f in frames)
        return frames

    zmq.asyncio.Socket.send = counted_send  # type: ignore[method-assign]
    zmq.asyncio.Socket.recv_multipart = counted_recv  # type: ignore[method-assign]

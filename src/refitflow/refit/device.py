"""Where a refit's device work runs, and how the pipeline waits for it without blocking the event loop.

``DeviceLane`` gives every CUDA device of the destination one dedicated *refit stream*. The device
work of a bucket (translate's views and FP8 assembly buffers, apply's copies and casts, verify's
hashing, FP8 quantisation) is issued under ``use(devices)``, which makes those streams current in
the calling thread; ``record(devices)`` returns *marks* (one CUDA event per device) and
``await wait(marks)`` returns when that work is done, waiting in a worker thread. CPU tensors have
no streams: ``use`` is a null context, ``record`` returns no marks and ``wait``, ``quiesce`` and
``drain`` return at once, so the pipeline runs the same code path on CPU and CUDA.

Ordering (what each wait protects):

- ``quiesce()`` after ``begin`` (the fence is ``updating`` in place) and before the first byte is
  written: every kernel the server queued earlier — including reads of a storage a shadow swap
  retired — finishes before a transfer or copy overwrites it. Also before a graph-safe shadow commit.
- verify ``wait``s for a bucket's marks before it frees the bucket's staging lease, so the next
  bucket's transfer never lands in staging bytes a copy still reads.
- commit ``drain()``s every stream before ``prepare``: a prepared version has no byte in flight.

A publisher marks its caller's current streams (``mark_current``) and waits for them before it digests
and announces a version: the trainer's step, as queued on the stream that called ``publish``, is
finished before a digest or a peer reads the bytes.

Transfers (NIXL, loopback) complete on the host: their bytes are in place when ``read`` returns,
so device work issued afterwards on any stream sees them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import anyio.to_thread
import torch

from refitflow.core.errors import ConfigError

__all__ = ["SUPPORTED_DEVICES", "DeviceLane", "Marks", "check_device", "devices_of", "mark_current", "wait_marks"]

SUPPORTED_DEVICES = ("cpu", "cuda")
Marks = tuple[Any, ...]  # torch.cuda.Event per CUDA device; empty on CPU


def check_device(device: torch.device, what: str) -> None:
    """Refuse a device refitflow cannot move bytes to or from (meta, mps, xla, ...) with a ``ConfigError``."""
    if device.type not in SUPPORTED_DEVICES:
        raise ConfigError(f"{what} is on device {device}; refitflow moves weights between CPU and CUDA memory only")


def devices_of(tensors: Iterable[torch.Tensor]) -> tuple[torch.device, ...]:
    """The distinct devices of ``tensors``, in a stable order (CPU first, then CUDA by index)."""
    return tuple(sorted({t.device for t in tensors}, key=lambda d: (d.type != "cpu", d.type, d.index or 0)))


def mark_current(devices: Iterable[torch.device | str]) -> Marks:
    """Marks after the work queued so far on this thread's *current* stream of each CUDA device (the caller's)."""
    return _marks(torch.cuda.current_stream(d) for d in devices if torch.device(d).type == "cuda")


async def wait_marks(marks: Marks) -> None:
    """Return when the marked work is done (waited in a worker thread; at once when there is none)."""
    if marks:
        await anyio.to_thread.run_sync(_synchronize, marks)


class DeviceLane:
    """One refit stream per CUDA device of the destination; no-ops of the same shape on CPU."""

    def __init__(self, devices: Iterable[torch.device | str]) -> None:
        self.devices = tuple(torch.device(d) for d in devices)
        for d in self.devices:
            check_device(d, "a destination parameter")
        self._streams: dict[torch.device, Any] = {}
        self._of: dict[tuple[torch.device | str, ...], tuple[Any, ...]] = {}  # devices -> their refit streams

    @property
    def cuda(self) -> tuple[torch.device, ...]:
        return tuple(d for d in self.devices if d.type == "cuda")

    def stream(self, device: torch.device | str) -> Any:
        """The refit stream of a CUDA device (made on first use); None for the CPU."""
        d = torch.device(device)
        if d.type != "cuda":
            return None
        if d not in self._streams:
            self._streams[d] = torch.cuda.Stream(device=d)
        return self._streams[d]

    def streams_of(self, devices: Iterable[torch.device | str]) -> tuple[Any, ...]:
        """The refit streams of ``devices``' CUDA devices (none on CPU), looked up once per tuple of devices (a
        bucket's: every bucket asks, every bucket of a plan has the same few)."""
        key = devices if isinstance(devices, tuple) else tuple(devices)
        found = self._of.get(key)
        if found is None:
            found = self._of[key] = tuple(s for s in map(self.stream, key) if s is not None)
        return found

    def use(self, devices: Iterable[torch.device | str]) -> contextlib.AbstractContextManager[None]:
        """Make the refit streams of ``devices`` current in this thread (enter it in the thread doing the work);
        a null context on CPU."""
        streams = self.streams_of(devices)
        return _current(streams) if streams else _NOTHING

    def record(self, devices: Iterable[torch.device | str]) -> Marks:
        """Marks after the work issued so far on the refit streams of ``devices``."""
        streams = self.streams_of(devices)
        return _marks(streams) if streams else ()

    async def wait(self, marks: Marks) -> None:
        """Return when the marked work is done (waited in a worker thread; at once when there is none)."""
        await wait_marks(marks)

    async def drain(self) -> None:
        """Return when everything issued on every refit stream is done."""
        await self.wait(self.record(self.devices))

    async def quiesce(self) -> None:
        """Return when every kernel queued so far on the destination's CUDA devices is done (any stream)."""
        if self.cuda:
            await anyio.to_thread.run_sync(_synchronize_devices, self.cuda)


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _current(streams: tuple[Any, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for s in streams:
            stack.enter_context(torch.cuda.stream(s))
        yield


def _marks(streams: Iterable[Any]) -> Marks:
    """One event recorded on each stream, after the work queued on it so far."""
    marks = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        marks.append(event)
    return tuple(marks)


def _synchronize(marks: Marks) -> None:
    for event in marks:
        event.synchronize()


def _synchronize_devices(devices: tuple[torch.device, ...]) -> None:
    for d in devices:
        torch.cuda.synchronize(d)

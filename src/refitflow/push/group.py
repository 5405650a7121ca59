"""The process group a trainer shares with inference ranks for the stream, and its broadcasts.

``stream_group(address, world_size=, rank=)`` builds it from nothing but an address (a ``TCPStore``
hosted by rank 0, then a new gloo group — nccl where CUDA is present), without touching the
default group an inference engine already has, and without any RL framework. ``StreamGroup`` wraps
any torch ``ProcessGroup`` (a group the host built itself works the same way).

Every broadcast has a deadline (the group's timeout, or one given per call) and runs in a worker
thread, off the event loop. A broadcast cannot be half received: after any failed or timed-out
collective, or when a rank decides it cannot take the next frame, that rank tears down its end of
the group (``close``) and raises ``OutOfStepError``; its peers' next collective then fails at once
(connection closed) instead of waiting. A torn-down group is never used again: build a new one.
"""

from __future__ import annotations

import datetime
from typing import Any

import anyio.to_thread
import torch

from refitflow.core.errors import ConfigError, OutOfStepError, TransportError

__all__ = ["StreamGroup", "stream_group"]


class StreamGroup:
    """One rank's end of the stream's process group."""

    def __init__(self, pg: Any, *, timeout_s: float, device: torch.device | str = "cpu", store: Any = None) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.pg = pg
        self.rank: int = pg.rank()
        self.size: int = pg.size()
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self._store = store  # rank 0 hosts the store: it lives as long as the group
        self.closed = False

    def broadcast_sync(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        """Broadcast ``tensor`` from group rank ``src`` (blocking); any failure tears this end down."""
        import torch.distributed as dist

        if self.closed:
            raise OutOfStepError("the stream group was torn down after an earlier failure; build a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = datetime.timedelta(seconds=timeout_s or self.timeout_s)
        try:
            self.pg.broadcast([tensor], opts).wait()
            if tensor.device.type == "cuda":  # nccl: the bytes are there once the stream got them
                torch.cuda.current_stream(tensor.device).synchronize()
        except RuntimeError as exc:
            self.close()
            raise OutOfStepError(f"broadcast from rank {src} failed, left the stream group: {exc}") from exc

    async def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        """``broadcast_sync`` in a worker thread; a cancellation takes effect when it returns (bounded)."""
        await anyio.to_thread.run_sync(self.broadcast_sync, tensor, src, timeout_s)

    def close(self) -> None:
        """Tear down this rank's end of the group (idempotent); peers' next collective fails at once."""
        if self.closed:
            return
        self.closed = True
        try:
            self.pg.abort()
        except (AttributeError, RuntimeError):  # no abort in this torch, or already broken
            pass
        self.pg = None  # the last reference: the backend closes its connections


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"stream group address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def stream_group(
    address: str, *, world_size: int, rank: int, timeout_s: float = 60.0, backend: str | None = None
) -> StreamGroup:
    """Join the stream's process group: ``address`` is rank 0's ``host:port`` (rank 0 hosts the store).

    Blocks until all ``world_size`` ranks joined (at most ``timeout_s``). ``backend``: ``gloo`` or
    ``nccl``; default nccl when CUDA is present (on the current CUDA device), else gloo.
    """
    import torch.distributed as dist

    host, port = _host_port(address)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} outside a world of {world_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("refitflow-stream", store)
        if backend == "gloo":
            return StreamGroup(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), timeout_s=timeout_s,
                               store=store)  # fmt: skip
        return _nccl(prefixed, rank, world_size, timeout, store)
    except (RuntimeError, ValueError) as exc:  # DistStoreError and gloo rendezvous errors are RuntimeErrors
        raise TransportError(f"could not join the stream group at {address} as rank {rank}: {exc}") from exc


def _nccl(store: Any, rank: int, size: int, timeout: datetime.timedelta, keep: Any) -> StreamGroup:
    """An nccl group on the current CUDA device (the seam for GPUs; not exercised on CPU machines)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    device = torch.device("cuda", torch.cuda.current_device())
    return StreamGroup(pg, timeout_s=timeout.total_seconds(), device=device, store=keep)

"""One answer for every rank of an SGLang server: SGLang replies to ``/update_weights_from_tensor`` with its
TP rank 0's result alone, so a rank in doubt, or fenced, while rank 0 committed would be answered
``success: true``. At the end of each update every rank's loader exchanges its outcome with the others over
SGLang's world CPU group (``settle``, a collective every rank reaches: the loader catches its own failure
first), and each rank then raises if any rank did not commit — its own error first, the others' after it —
so rank 0's answer speaks for the server.

The answer also says whether the server may serve (``NOT_SERVING``, read by the serving gate,
``gate.py``): it may when every rank is ready on one committed version (a failed shadow update leaves the
previous one), and must not when a rank is fenced, in doubt, or ranks serve different versions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from refitflow.core.errors import RefitError

__all__ = ["NOT_SERVING", "Answer", "exchange", "serving", "settle", "world_rank"]

log = logging.getLogger(__name__)

NOT_SERVING = "refitflow: this server must not serve"  # in a failed answer: the gate closes


@dataclass(frozen=True)
class Answer:
    rank: int
    error: str | None  # None: this rank committed the version
    fence: str | None  # ready, updating, fenced (None: no session)
    version: int | None  # the version it serves


def world_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group() -> Any:
    """SGLang's world CPU group (every rank of the server), or None outside a distributed server."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().world_group.cpu_group
    except (AttributeError, RuntimeError, ValueError, ImportError):
        return None


def exchange(mine: Answer) -> list[Answer]:
    """Every rank's answer, in rank order (just this one outside a distributed server)."""
    import torch.distributed as dist

    group = _group()
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return sorted(out, key=lambda a: a.rank)


def serving(every: list[Answer]) -> str | None:
    """Why the server must not serve (None: it may)."""
    fenced = [a.rank for a in every if a.fence not in ("ready", None)]
    if fenced:
        states = ", ".join(f"rank {a.rank} {a.fence}" for a in every if a.rank in fenced)
        return f"{NOT_SERVING}: {states}"
    versions = {a.version for a in every if a.fence == "ready"}
    if len(versions) > 1:
        return f"{NOT_SERVING}: its ranks serve different versions ({sorted(versions, key=str)})"
    return None


def settle(mine: Answer, failure: Exception | None) -> None:
    """Exchange outcomes; raise (this rank's error first) unless every rank committed."""
    every = exchange(mine)
    others = [a for a in every if a.error is not None and a.rank != mine.rank]
    stop = serving(every)
    if failure is None and not others:
        return
    parts = [f"rank {a.rank}: {a.error}" for a in others]
    committed = [a.rank for a in every if a.error is None]
    if committed:
        parts.append(f"ranks {committed} committed version {mine.version if mine.error is None else '?'}")
    if stop:
        parts.append(stop)
    note = "; ".join(parts)
    if failure is not None:
        if note:
            failure.add_note(note)
        raise failure
    log.error("refitflow: this rank committed, but %s", note)
    raise RefitError(f"not every rank committed: {note}", version=mine.version)

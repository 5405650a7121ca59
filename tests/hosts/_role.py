"""One role of the multi-host test bed, in its own process inside a simulated host (``_netns``).

``argv[1]``: ``{"role": "trainer" | "rank", ...}``. It prints ``RF {"ready": true}`` and answers JSON lines
on stdin with ``RF <json>`` lines (``LineChild``):

- **trainer** ``{"registry", "tp", "kind"}``: one process holding ``tp`` Megatron publisher ranks of the tiny
  model (``tests/integrations/_tiny``), NIXL over TCP. ``{"version": v, "seed": s}`` publishes (``late``: the
  ranks whose registry did not answer: announced once it does); ``{"served": true}`` answers the bytes
  peers read from it (its egress).
- **rank** ``{"registry", "engine", "rank", "tp", "votes", "kind", "relay"}``: one inference rank of a TP
  engine in vLLM's fused layout, shadow mode, voting over ZMQ with the engine's other ranks (TCP, on the
  hosts' addresses), serving relays when asked. ``{"refit": v, "timeout": t}`` prepares, votes and commits
  (``EngineMember.refit``) and answers its outcome (``"slow_pull": s``: first ``RF {"pulling": true}`` after
  its first bucket, then the pipeline holds ``s`` seconds); ``{"holds": s}`` whether its parameters are exactly
  version ``s``'s slice; ``{"pause_after_ballot": true}`` makes its next vote wait 3 s after sending its
  ballot (announced by an ``RF {"voted": attempt}`` line), so a test can cut it off before the verdict.

Every await that waits on another host has a deadline; UCX is confined to TCP on ``eth0``
(``UCX_TLS=tcp``), as between real hosts without RDMA.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

import anyio
import anyio.to_thread
import torch

import refitflow as rf
from refitflow.engine.vote import Ballot, Verdict
from refitflow.layouts import Parallel, fused, megatron
from refitflow.layouts.canonical import from_canonical
from refitflow.layouts.wire import layout_metadata
from refitflow.metrics import NullObserver
from tests._keys import KEYS
from tests._procs import dumpable
from tests.integrations._tiny import canonical, dims

PREFIX = "RF "


def say(doc: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(doc), flush=True)


async def lines() -> Any:
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        yield json.loads(line)


async def trainer(spec: dict[str, Any]) -> None:
    d, tp = dims(spec["kind"]), spec["tp"]
    places = [Parallel(tp=tp, tp_rank=r) for r in range(tp)]
    identity = rf.Identity(model="hosts", layout="megatron")
    held: list[dict[str, torch.Tensor]] = []
    async with contextlib.AsyncExitStack() as stack:
        pubs = [
            await stack.enter_async_context(rf.Publisher(
                spec["registry"], identity=identity, rank=r, world_size=tp, transport="nixl", security=KEYS.client,
                metadata=layout_metadata("megatron", d, p),
            ))
            for r, p in enumerate(places)
        ]  # fmt: skip
        say({"ready": True})
        async for cmd in lines():
            if cmd.get("served"):
                say({"served": sum(p._transport.served_bytes for p in pubs)})  # type: ignore[union-attr]
                continue
            canon = canonical(spec["kind"], cmd["seed"])
            fresh = [from_canonical(megatron.layout(d, p), canon) for p in places]
            if not held:
                held = fresh
            for mine, new in zip(held, fresh, strict=True):
                for name, t in new.items():
                    mine[name].copy_(t)
            late = []
            with anyio.fail_after(120):
                for pub, tensors in zip(pubs, held, strict=True):
                    try:
                        await pub.publish(cmd["version"], tensors)
                    except rf.RefitTimeoutError as exc:  # the registry unreachable: announced once it answers
                        late.append(str(exc))
            say({"published": cmd["version"], "late": late})


class PauseAfterBallot:
    """A vote channel that, once armed, sends its ballot and then hears nothing for 3 s (announced by an
    ``RF {"voted": ...}`` line): the test cuts the host off in that window, so the verdict never arrives."""

    def __init__(self, inner: rf.ZmqVote) -> None:
        self.inner, self.armed = inner, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def vote(self, ballot: Ballot, timeout: float) -> Verdict:
        if not self.armed:
            return await self.inner.vote(ballot, timeout)
        self.armed = False
        node = self.inner.node
        receive, deaf_until = node.receive, time.monotonic() + 3.0

        def deaf(message: Any) -> Any:
            return [] if time.monotonic() < deaf_until else receive(message)

        node.receive = deaf  # type: ignore[method-assign]
        say({"voted": ballot.version})
        try:
            return await self.inner.vote(ballot, timeout)  # the ballot goes out before its first await
        finally:
            node.receive = receive  # type: ignore[method-assign]


class SlowPull(NullObserver):
    """Once armed (``arm(s)``): after the first bucket is pulled, announces ``RF {"pulling": true}`` and holds
    the pipeline ``s`` seconds, so a test can cut a host off in the middle of a refit."""

    def __init__(self) -> None:
        self.hold = 0.0

    def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
        if stage == "pull" and self.hold:
            hold, self.hold = self.hold, 0.0
            say({"pulling": True})
            time.sleep(hold)  # the rank's loop stops: nothing more is read until the test acted


def slices(kind: str, seed: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    return from_canonical(fused.layout(dims(kind), Parallel(tp=tp, tp_rank=rank)), canonical(kind, seed))


async def rank(spec: dict[str, Any]) -> None:
    kind, tp, r = spec["kind"], spec["tp"], spec["rank"]
    layout = fused.layout(dims(kind), Parallel(tp=tp, tp_rank=r))
    params = {n: torch.zeros(lt.shape, dtype=torch.bfloat16) for n, lt in layout.items()}
    identity = rf.Identity(model="hosts", layout="megatron")
    options = {"read_timeout_s": spec.get("read_timeout_s", 10.0), "relay_wait_s": 3.0}
    slow = SlowPull()
    async with (
        rf.Receiver(params, spec["registry"], identity=identity, mode="shadow", layout=layout, transport="nixl",
                    security=KEYS.client,
                    receiver_id=f"{spec['engine']}-r{r}", serve_replicas=spec.get("relay", False), budget_bytes=1 << 14,
                    observer=slow, **options) as recv,
        rf.ZmqVote(r, spec["votes"], group=spec["engine"], server_security=KEYS.server,
                   client_security=KEYS.client) as vote,
    ):  # fmt: skip
        channel = PauseAfterBallot(vote)
        member = rf.EngineMember(recv, channel, vote_timeout=spec.get("vote_timeout_s", 30.0))  # type: ignore[arg-type]
        say({"ready": True})
        async for cmd in lines():
            if "refit" in cmd:
                slow.hold = cmd.get("slow_pull", 0.0)
                try:
                    with anyio.fail_after(cmd.get("timeout", 60) + 30):
                        out = await member.refit(cmd["refit"], timeout=cmd.get("timeout", 60))
                    say({"committed": out.committed, "version": out.version, "reason": out.reason,
                         "error": None if out.error is None else f"{type(out.error).__name__}: {out.error}",
                         "fence": recv.fence.state.value, "in_doubt": member.in_doubt})  # fmt: skip
                except Exception as exc:
                    say({"committed": False, "version": None, "reason": "", "error": f"{type(exc).__name__}: {exc}",
                         "fence": recv.fence.state.value, "in_doubt": member.in_doubt})  # fmt: skip
            elif "holds" in cmd:
                want = slices(kind, cmd["holds"], tp, r)
                say({"holds": all(torch.equal(params[n], t) for n, t in want.items()),
                     "committed_version": recv.status.committed_version, "fence": recv.fence.state.value})  # fmt: skip
            elif cmd.get("pause_after_ballot"):
                channel.armed = True
                say({"armed": True})


def main() -> None:
    dumpable()
    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    anyio.run({"trainer": trainer, "rank": rank}[spec["role"]], spec)


if __name__ == "__main__":
    main()

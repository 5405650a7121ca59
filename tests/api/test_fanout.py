"""Pipelined fan-out in one process (loopback): receivers relay verified bytes to each other before they commit."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import anyio
import orjson
import pytest
import torch

import refitflow as rf
from refitflow.core.fanout import HeldBox, RelayOffer, RelayParam
from refitflow.metrics import NullObserver
from refitflow.registry.service.fanout import Relays
from refitflow.transports import LoopbackTransport
from refitflow.transports.base import Read
from tests.conftest import mlp, params, same
from tests.layouts._models import _model, places

SMALL = {"relay_bucket_bytes": 16 * 1024}  # several buckets (each at least a digest tile): progress by bucket


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


async def _together(receivers: Sequence[rf.Receiver], version: int) -> list[rf.RefitResult]:
    """Refit every receiver at once; their results in receiver order."""
    results: dict[int, rf.RefitResult] = {}

    async def one(i: int, r: rf.Receiver) -> None:
        results[i] = await r.refit(version)

    async with anyio.create_task_group() as tg:
        for i, r in enumerate(receivers):
            tg.start_soon(one, i, r)
    return [results[i] for i in range(len(receivers))]


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_receivers_starting_together_cost_the_trainer_one_copy_and_are_bit_exact(mode: str) -> None:
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    trainer, servers = mlp(100), [mlp(i) for i in range(4)]
    trainer_transport, transports = LoopbackTransport(), [LoopbackTransport() for _ in servers]
    with anyio.fail_after(30):
        async with rf.Publisher(registry, identity=ident, transport=trainer_transport) as pub:
            receivers = [rf.Receiver(s, registry, identity=ident, mode=mode, transport=t, serve_replicas=True, **SMALL)
                         for s, t in zip(servers, transports, strict=True)]  # fmt: skip
            for r in receivers:
                await r.__aenter__()
            try:
                await pub.publish(1, dict(trainer.named_parameters()))
                results = await _together(receivers, 1)
                assert all(same(s, params(trainer)) for s in servers)
                assert trainer_transport.served_bytes == _model_bytes(trainer)  # one copy: a chain of relays
                assert sorted(r.relay_bytes for r in results) == [0, *[_model_bytes(trainer)] * 3]
                # a receiver that serves nobody reads from a relay too; one that started later from a committed one
                late = mlp(7)
                async with rf.Receiver(late, registry, identity=ident, transport=LoopbackTransport()) as reader:
                    assert (await reader.refit(1)).relay_bytes == _model_bytes(trainer) and same(late, params(trainer))
                assert trainer_transport.served_bytes == _model_bytes(trainer)
            finally:
                for r in receivers:
                    await r.__aexit__(None, None, None)


@pytest.mark.asyncio
async def test_a_relay_that_dies_makes_its_reader_read_from_the_trainer() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    trainer, first, second = mlp(100), mlp(1), mlp(2)
    trainer_transport = LoopbackTransport()
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident, transport=trainer_transport) as pub,
            rf.Receiver(first, registry, identity=ident, mode="shadow", serve_replicas=True) as a,
            rf.Receiver(second, registry, identity=ident, mode="shadow", budget_bytes=4096) as b,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            await a.refit(1)
            assert a._transport is not None
            await a._transport.aclose()  # the relay dies without leaving (the registry still names it)
            result = await b.refit(1)
            assert result.version == 1 and same(second, params(trainer))
            assert result.rerouted_bytes == result.nbytes == _model_bytes(trainer) and result.relay_bytes == 0
            assert trainer_transport.served_bytes == 2 * _model_bytes(trainer)


class PauseBefore(LoopbackTransport):
    """Loopback that stops before its first read from ``peer`` until ``go`` is set (``paused`` says it waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.peer, self.paused, self.go = "", anyio.Event(), anyio.Event()

    async def read(self, reads: Sequence[Read], *, key: Hashable | None = None, count: bool = True) -> None:
        if any(r.peer == self.peer for r in reads) and not self.paused.is_set():
            self.paused.set()
            await self.go.wait()
        await super().read(reads, key=key, count=count)


@pytest.mark.asyncio
async def test_an_in_place_relay_that_begins_the_next_version_is_not_read_from() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    v1, v2 = mlp(100), mlp(101)
    relay_model, reader_model = mlp(1), mlp(2)
    pausing = PauseBefore()
    began = anyio.Event()

    class Began(NullObserver):
        def stage_item(self, stage: str, nbytes: int, seconds: float) -> None:
            if stage == "discover":
                began.set()

    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(relay_model, registry, identity=ident, serve_replicas=True, observer=Began()) as relay,
            rf.Receiver(reader_model, registry, identity=ident, transport=pausing) as reader,
        ):
            await pub.publish(1, dict(v1.named_parameters()))
            await relay.refit(1)
            assert relay._transport is not None
            pausing.peer = relay._transport.agent
            result: list[rf.RefitResult] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: _append(result, reader.refit(1)))
                await pausing.paused.wait()  # the reader is about to read its relay's status
                await pub.publish(2, dict(v2.named_parameters()))  # the trainer keeps version 1's tensors
                tg.start_soon(relay.refit, 2)  # in place: its storage says version 2 before any byte changes
                await began.wait()
                pausing.go.set()
        assert same(reader_model, params(v1)) and same(relay_model, params(v2))
        assert result[0].relay_bytes == 0 and result[0].rerouted_bytes == _model_bytes(v1)


async def _append(out: list, awaitable) -> None:  # type: ignore[no-untyped-def]
    out.append(await awaitable)


@pytest.mark.asyncio
async def test_a_relay_that_makes_no_progress_is_left_for_the_trainer_within_relay_wait_s() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    trainer = mlp(100)
    stalled = PauseBefore()  # the relay stops before its first read: it never verifies anything
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(mlp(1), registry, identity=ident, transport=stalled, serve_replicas=True) as relay,
            rf.Receiver(mlp(2), registry, identity=ident, relay_wait_s=0.3) as reader,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            stalled.peer = pub.transport.agent
            async with anyio.create_task_group() as tg:
                tg.start_soon(relay.refit, 1)
                await stalled.paused.wait()  # it joined the relays (with its plan) and stalls
                result = await reader.refit(1)
                assert result.rerouted_bytes == result.nbytes == _model_bytes(trainer) and result.relay_bytes == 0
                stalled.go.set()


@pytest.mark.asyncio
async def test_bytes_a_relay_sends_that_do_not_match_are_read_again_from_the_trainer() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    trainer, reader_model = mlp(100), mlp(2)
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(mlp(1), registry, identity=ident, serve_replicas=True) as relay,
            rf.Receiver(reader_model, registry, identity=ident) as reader,
        ):
            await pub.publish(1, dict(trainer.named_parameters()))
            await relay.refit(1)
            relay.destination.live("0.weight")[3, 3] += 1  # behind refitflow's back, after it verified it
            result = await reader.refit(1)
        assert same(reader_model, params(trainer))
        assert 0 < result.rerouted_bytes < result.nbytes and result.relay_bytes > 0


@pytest.mark.asyncio
async def test_megatron_sharded_publications_are_relayed_box_by_box_between_fused_layout_ranks() -> None:
    """A Megatron TP=2 trainer; three engines of two fused-layout (vLLM) ranks each refit at once: rank r of
    each engine reads what it needs from rank r of the engine that joined before it."""
    from refitflow.layouts import canonical_shapes, hf
    from refitflow.layouts.canonical import from_canonical, to_canonical
    from refitflow.layouts.wire import LAYOUTS, layout_metadata

    model = _model("llama", 2).float()
    d = hf.dims_from_config(model.config)
    canon = to_canonical([(hf.layout(d), model.state_dict())], canonical_shapes(d))
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    tp = places((2, 1))
    maps = [LAYOUTS["fused"](d, p) for p in tp] * 3
    ranks = [{n: torch.zeros(lt.shape) for n, lt in m.items()} for m in maps]
    trainers = [LoopbackTransport() for _ in tp]
    with anyio.fail_after(60):
        pubs = [rf.Publisher(registry, identity=ident, rank=r, world_size=2, transport=trainers[r],
                             metadata=layout_metadata("megatron", d, p)) for r, p in enumerate(tp)]  # fmt: skip
        receivers = [rf.Receiver(t, registry, identity=ident, layout=m, serve_replicas=True, **SMALL)
                     for m, t in zip(maps, ranks, strict=True)]  # fmt: skip
        for x in [*pubs, *receivers]:
            await x.__aenter__()
        try:
            for pub, p in zip(pubs, tp, strict=True):
                await pub.publish(1, from_canonical(LAYOUTS["megatron"](d, p), canon))
            results = await _together(receivers, 1)
        finally:
            for x in [*receivers, *pubs]:
                await x.__aexit__(None, None, None)
    for engine in range(3):
        got = to_canonical(list(zip(maps[2 * engine : 2 * engine + 2], ranks[2 * engine : 2 * engine + 2],
                                    strict=True)), canonical_shapes(d))  # fmt: skip
        assert all(torch.equal(got[n], t) for n, t in canon.items())
    one_engine = results[0].nbytes + results[1].nbytes  # what one engine's two ranks read
    egress = sum(t.served_bytes for t in trainers)
    assert sum(r.relay_bytes == r.nbytes for r in results) == 4  # every rank but the first of its place
    assert egress <= one_engine, (egress, one_engine)  # one engine's worth, not three


def _offer(version: int, rid: str, layout: str) -> RelayOffer:
    return RelayOffer(identity=rf.Identity(model="m"), version=version, receiver=rid,
                      source=rf.SourceAddress(transport="loopback", agent=rid), status=0, params=(), held=(),
                      layout=layout)  # fmt: skip


def test_the_registry_chains_relays_of_one_layout_in_join_order() -> None:
    """Relays chain by layout: a relay of another layout holds other slices and reads in another order (a plan
    starts at its rank's place), so a joiner with no relay of its own layout before it reads the trainer."""
    relays = Relays()
    assert relays.join("a", "L", _offer(1, "a", "L")) is None  # the first reads the trainer
    assert relays.join("b", "L", _offer(1, "b", "L")).receiver == "a"  # type: ignore[union-attr]
    assert relays.join("x", "M", _offer(1, "x", "M")) is None  # none of its own layout: the trainer, not b
    assert relays.join("c", "L", _offer(1, "c", "L")).receiver == "b"  # type: ignore[union-attr]
    assert relays.join("d", "M", _offer(1, "d", "M")).receiver == "x"  # type: ignore[union-attr]
    assert relays.join("leaf", "L", None).receiver == "c"  # type: ignore[union-attr]  # serves nobody: reads the last
    assert relays.join("other", "N", None) is None  # a reader of a layout nobody relays
    relays.leave("c")
    assert relays.join("leaf2", "L", None).receiver == "b"  # type: ignore[union-attr]  # the least read, latest on ties
    assert relays.join("leaf3", "L", None).receiver == "a"  # type: ignore[union-attr]  # b has two now: the least read
    assert relays.join("any", "", None) is not None  # one that names no layout: any relay


def test_a_reader_is_given_its_last_relay_again_when_it_joined_before_and_is_at_most_one_reader_busier() -> None:
    """Chains that stay: receivers seldom join in one order twice, and a reader whose relay changed describes and
    prepares its relayed reads again; its last relay is taken again when it joined before it and has at most one
    reader more than the least read relay of its layout."""
    relays = Relays()
    assert relays.join("a", "L", _offer(1, "a", "L"), prefer="c") is None  # c has not joined: the trainer
    assert relays.join("b", "L", _offer(1, "b", "L"), prefer="a").receiver == "a"  # type: ignore[union-attr]
    assert relays.join("c", "L", _offer(1, "c", "L"), prefer="a").receiver == "a"  # type: ignore[union-attr]  # 1 vs 0
    assert relays.join("d", "L", _offer(1, "d", "L"), prefer="a").receiver == "c"  # type: ignore[union-attr]  # 2 vs 0
    assert relays.join("x", "M", _offer(1, "x", "M"), prefer="a") is None  # another layout's relay is never one
    assert relays.join("e", "L", None, prefer="nobody").receiver == "d"  # type: ignore[union-attr]  # as without


@pytest.mark.asyncio
async def test_the_registry_keeps_a_readers_relay_from_version_to_version_when_the_join_order_changes(ident) -> None:
    """Version 1 joins a, b, c (a chain: b reads a, c reads b); version 2 joins a, c, b: c cannot read b (not
    joined yet) and reads a, and b reads a again — its relayed reads replay — where join order alone gives c."""
    registry = rf.Registry()
    async with rf.Publisher(registry, identity=ident) as pub:
        ups: dict[int, dict[str, str | None]] = {}
        for version, order in ((1, "abc"), (2, "acb")):
            await pub.publish(version, {"w": torch.zeros(4, 4)})
            ups[version] = {}
            for rid in order:
                offer = RelayOffer(identity=ident, version=version, receiver=rid, source=pub.transport.address(),
                                   status=0, params=(RelayParam("w", "float32", (4, 4), 0),),
                                   held=(HeldBox(0, "w", ((0, 4), (0, 4)), 0, ((0, 4), (0, 4))),))  # fmt: skip
                up = await registry.relay_join(ident, version, rid, offer=offer)
                ups[version][rid] = None if up is None else up.receiver
        assert ups == {1: {"a": None, "b": "a", "c": "b"}, 2: {"a": None, "c": "a", "b": "a"}}, ups
        await registry.unregister_receiver(ident, "b")  # gone: its memory too (a new b joins as anyone does)
        await pub.publish(3, {"w": torch.zeros(4, 4)})
        for rid in "acb":
            offer = RelayOffer(identity=ident, version=3, receiver=rid, source=pub.transport.address(), status=0,
                               params=(RelayParam("w", "float32", (4, 4), 0),),
                               held=(HeldBox(0, "w", ((0, 4), (0, 4)), 0, ((0, 4), (0, 4))),))  # fmt: skip
            up = await registry.relay_join(ident, 3, rid, offer=offer)
            ups.setdefault(3, {})[rid] = None if up is None else up.receiver
        assert ups[3] == {"a": None, "c": "a", "b": "c"}, ups[3]


@pytest.mark.asyncio
async def test_a_relay_offer_must_hold_published_shards_in_their_dtype(ident) -> None:
    registry = rf.Registry()
    async with rf.Publisher(registry, identity=ident) as pub:
        await pub.publish(1, {"w": torch.zeros(4, 4)})
        params_ = (RelayParam("w", "bfloat16", (4, 4), 0),)
        bad = [
            RelayOffer(identity=ident, version=1, receiver="r", source=pub.transport.address(), status=0,
                       params=params_, held=(HeldBox(0, "w", ((0, 4), (0, 4)), 0, ((0, 4), (0, 4))),)),  # dtype
            RelayOffer(identity=ident, version=1, receiver="r", source=pub.transport.address(), status=0,
                       params=(RelayParam("w", "float32", (4, 4), 0),),
                       held=(HeldBox(0, "v", ((0, 4), (0, 4)), 0, ((0, 4), (0, 4))),)),  # not published
            RelayOffer(identity=ident, version=1, receiver="r", source=pub.transport.address(), status=0,
                       params=(RelayParam("w", "float32", (4, 4), 0),),
                       held=(HeldBox(0, "w", ((0, 8), (0, 2)), 0, ((0, 4), (0, 4))),)),  # outside the shard
        ]  # fmt: skip
        for offer in bad:
            with pytest.raises(rf.ManifestError):
                await registry.relay_join(ident, 1, "r", offer=offer)
        with pytest.raises(rf.VersionError):
            await registry.relay_join(ident, 2, "r")


@pytest.mark.asyncio
async def test_receivers_of_a_version_still_relay_it_once_a_newer_one_is_complete(ident) -> None:
    registry = rf.Registry()
    await registry.register_receiver(ident, "a")  # not done with version 1: it stays held
    async with rf.Publisher(registry, identity=ident) as pub:
        await pub.publish(1, {"w": torch.zeros(4, 4)})
        await pub.publish(2, {"w": torch.ones(4, 4)})
        offer = RelayOffer(identity=ident, version=1, receiver="a", source=pub.transport.address(), status=0,
                           params=(RelayParam("w", "float32", (4, 4), 0),),
                           held=(HeldBox(0, "w", ((0, 4), (0, 4)), 0, ((0, 4), (0, 4))),))  # fmt: skip
        assert await registry.relay_join(ident, 1, "a", offer=offer) is None
        assert (await registry.relay_join(ident, 1, "b")) == offer  # a laggard reading version 1


@pytest.mark.asyncio
async def test_relayed_names_the_newest_complete_version_a_peer_offers_in_the_registry_and_its_service(ident) -> None:
    """What a receiver joining a running fleet asks first (``relayed``): the newest version a peer relays —
    not a newer one nobody relays yet — and None once no peer relays anything; the same over the service."""
    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, rf.RegistryClient(server.address) as client:
            registry = server.registry
            await registry.register_receiver(ident, "a")  # not done with version 1: it stays held
            async with rf.Publisher(registry, identity=ident) as pub:
                await pub.publish(1, {"w": torch.zeros(4, 4)})
                assert await registry.relayed(ident) is None and await client.relayed(ident) is None
                offer = RelayOffer(identity=ident, version=1, receiver="a", source=pub.transport.address(), status=0,
                                   params=(RelayParam("w", "float32", (4, 4), 0),),
                                   held=(HeldBox(0, "w", ((0, 4), (0, 4)), 0, ((0, 4), (0, 4))),))  # fmt: skip
                await registry.relay_join(ident, 1, "a", offer=offer)
                await registry.relay_join(ident, 1, "reader")  # a reader offers nothing
                await pub.publish(2, {"w": torch.ones(4, 4)})  # complete, relayed by nobody yet
                assert await registry.relayed(ident) == 1 and await client.relayed(ident) == 1
                await registry.relay_leave(ident, "a")
                assert await registry.relayed(ident) is None and await client.relayed(ident) is None


@pytest.mark.asyncio
async def test_offers_of_a_layout_the_registry_holds_travel_compact_and_a_registry_that_lost_it_gets_them_whole(
    ident,
) -> None:
    """An offer goes compact (address, status and regions alone) — refused by a registry that does not hold its
    layout, which then gets it whole, once — so later offers of that layout (next versions, other receivers of
    the same geometry) cost O(1); the upstream comes back compact to a joiner that knows its layout — the same
    offers on both sides."""

    def offer(version: int, receiver: str, first_region: int) -> RelayOffer:
        params = tuple(RelayParam(f"w{i}", "float32", (4, 4), first_region + i) for i in range(50))
        held = tuple(HeldBox(0, f"w{i}", ((0, 4), (0, 4)), i, ((0, 4), (0, 4))) for i in range(50))
        return RelayOffer(identity=ident, version=version, receiver=receiver, source=rf.SourceAddress(
            transport="loopback", agent=receiver), status=7, params=params, held=held)  # fmt: skip

    with anyio.fail_after(30):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server, rf.RegistryClient(server.address) as a, \
                rf.RegistryClient(server.address) as b:  # fmt: skip
            sent: list[dict[str, Any]] = []
            request = a._request

            async def spy(op: str, **args: Any) -> Any:
                if op == "relay_join":
                    sent.append(args["offer"])
                return await request(op, **args)

            a._request = spy  # type: ignore[method-assign]
            replies: list[Any] = []
            b_request = b._request

            async def b_spy(op: str, **args: Any) -> Any:
                reply = await b_request(op, **args)
                replies.append(reply)
                return reply

            b._request = b_spy  # type: ignore[method-assign]
            await server.registry.register_receiver(ident, "a")  # every version stays held
            async with rf.Publisher(server.registry, identity=ident) as pub:
                for v in (1, 2):
                    await pub.publish(v, {f"w{i}": torch.zeros(4, 4) for i in range(50)})
                assert await a.relay_join(ident, 1, "a", offer=offer(1, "a", 0)) is None
                assert ["params" in o for o in sent] == [False, True]  # a layout nobody sent: refused, then whole
                assert await a.relay_join(ident, 2, "a", offer=offer(2, "a", 50)) is None
                assert sent[2]["regions"] == [[50, 50]] and "params" not in sent[2]
                assert len(orjson.dumps(sent[2])) < len(orjson.dumps(sent[1])) / 10
                up = await b.relay_join(ident, 2, "b", offer=offer(2, "b", 0))  # compact: a's layout, held there
                assert up == offer(2, "a", 50) and "layout" in replies[-1]  # its layout: it came compact
                assert await b.relay_join(ident, 2, "reader") == offer(2, "b", 0) and "layout" in replies[-1]
                await pub.publish(3, {f"w{i}": torch.zeros(4, 4) for i in range(50)})
                sent.clear()
                other = dataclasses.replace(offer(3, "a", 0), params=offer(3, "a", 0).params[:49],
                                            held=offer(3, "a", 0).held[:49], layout="")  # fmt: skip
                assert await a.relay_join(ident, 3, "a", offer=other) is None  # a layout the registry does not hold
                assert ["params" in o for o in sent] == [False, True]  # compact refused, then whole



class JoinAfter:
    """A registry whose ``relay_join`` waits for ``go`` (``joining`` says one waits): a reader that found its
    version and planned, held before it joins the version's relays."""

    def __init__(self, registry: Any) -> None:
        self.registry, self.joining, self.go = registry, anyio.Event(), anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.registry, name)

    async def relay_join(self, *args: Any, **kwargs: Any) -> Any:
        self.joining.set()
        await self.go.wait()
        return await self.registry.relay_join(*args, **kwargs)


@pytest.mark.asyncio
async def test_a_shadow_relay_that_swaps_storages_relays_the_version_it_serves_until_it_writes_that_storage() -> None:
    """A relay refitting version v + 1 in shadow mode with ``shadow_commit="swap"`` keeps offering v (its live
    storage, written again only by the refit of v + 2): a reader that found v before v + 1 was published, and joins
    v's relays after the relay moved on, reads v from the relay, not the trainer; once the relay refits v + 2 into
    that storage, v is offered by nobody."""
    registry, ident = rf.Registry(), rf.Identity(model="fanout")
    versions = {v: mlp(100 + v) for v in (1, 2, 3)}
    relay_model, late_models = mlp(1), [mlp(2), mlp(3)]
    held = [JoinAfter(registry), JoinAfter(registry)]
    await registry.register_receiver(ident, "holder")  # not done with any version: every one stays held
    with anyio.fail_after(30):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(relay_model, registry, identity=ident, mode="shadow", shadow_commit="swap",
                        serve_replicas=True) as relay,
            rf.Receiver(late_models[0], held[0], identity=ident) as late,
            rf.Receiver(late_models[1], held[1], identity=ident) as later,
        ):  # fmt: skip
            await pub.publish(1, dict(versions[1].named_parameters()))
            await relay.refit(1)
            for v, reader, pause in ((1, late, held[0]), (2, later, held[1])):
                results: list[rf.RefitResult] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_append, results, reader.refit(v))
                    await pause.joining.wait()  # the reader found version v and planned
                    await pub.publish(v + 1, dict(versions[v + 1].named_parameters()))
                    await relay.refit(v + 1)  # the relay moves on (into the storage that held v - 1)
                    pause.go.set()
                assert results[0].version == v and same(reader._model, params(versions[v]))
                assert results[0].relay_bytes == _model_bytes(versions[v])  # all of it from the relay
            assert same(relay_model, params(versions[3]))
            assert await registry.relay_join(ident, 1, "a reader") is None  # 1's storage holds 3: nobody offers 1
            assert await registry.relay_join(ident, 2, "a reader") is not None


@pytest.mark.asyncio
async def test_a_reader_replays_the_transfers_it_prepared_for_its_relay_version_after_version(monkeypatch) -> None:
    """Over NIXL: a relayed bucket's reads carry a key, so the reader prepares them once (its first version from
    that relay) and replays them after — not a preparation per relayed bucket per version; and a reader behind
    its relay submits relayed reads with the trainer's, in the window (``submit_ahead``), every bucket of them:
    the submitter waits for the relay's status to show a bucket verified, rather than leaving it to be read as
    it lands."""
    from refitflow.refit.fanout import reading
    from refitflow.refit.stages import pull
    from refitflow.transports.nixl import NixlTransport

    registry, ident = rf.Registry(), rf.Identity(model="fanout-nixl")
    trainer = {f"layers.{i}.weight": torch.randn(16384) for i in range(8)}  # 64 KiB each
    relay_dst, reader_dst = ({k: torch.zeros_like(t) for k, t in trainer.items()} for _ in range(2))
    transports = [NixlTransport() for _ in range(3)]
    # a bucket a tensor; a window of 2, so that the submitter is not a whole refit ahead of the first status read
    small = {"relay_bucket_bytes": 64 * 1024, "direct_bucket_bytes": 64 * 1024, "window_buckets": 2}
    prepared, ahead = [], []

    async def spied(*args: Any) -> Any:  # a spy, not a mock: the real function, its outcomes counted
        out = await reading.submit_ahead(*args)
        ahead.append(out is not None)
        return out

    monkeypatch.setattr(pull, "submit_ahead", spied)
    with anyio.fail_after(60):
        async with (
            rf.Publisher(registry, identity=ident, transport=transports[0]) as pub,
            rf.Receiver(relay_dst, registry, identity=ident, transport=transports[1], serve_replicas=True,
                        **small) as relay,
            rf.Receiver(reader_dst, registry, identity=ident, transport=transports[2], **small) as reader,
        ):  # fmt: skip
            for v in range(1, 4):
                for t in trainer.values():
                    t.add_(1)
                await pub.publish(v, trainer)
                assert (await relay.refit(v)).relay_bytes == 0
                ahead.clear()
                got = await reader.refit(v)
                assert got.relay_bytes == 8 * 16384 * 4 and got.rerouted_bytes == 0
                assert all(torch.equal(reader_dst[k], t) for k, t in trainer.items())
                assert ahead == [True] * 8  # the first too: the submitter read the relay's status first
                prepared.append(transports[2].prepared)
    assert prepared[1] == prepared[2] > 0  # version 3 prepared nothing new: relay reads and status read replayed


def test_a_reader_paces_its_status_reads_by_its_waits_for_the_relay() -> None:
    """Unknown pace: 0.2 ms doubling to 5 ms. Known (the reader waited about ``pace`` for each bucket so far):
    three quarters of it before the first read, then an eighth doubling — about two reads a bucket for a reader
    close behind its relay, where the doubling from 0.2 ms took five at 4 ms a bucket."""
    from itertools import accumulate, islice

    from refitflow.refit.fanout.reading import poll_sleeps

    assert list(islice(poll_sleeps(0.0), 7)) == pytest.approx([2e-4, 4e-4, 8e-4, 1.6e-3, 3.2e-3, 5e-3, 5e-3])
    assert list(islice(poll_sleeps(4e-3), 4)) == pytest.approx([3e-3, 5e-4, 1e-3, 2e-3])
    assert list(islice(poll_sleeps(1e-3), 3)) == pytest.approx([7.5e-4, 2e-4, 4e-4])  # never below 0.2 ms
    assert list(islice(poll_sleeps(0.1), 3)) == pytest.approx([5e-3, 5e-3, 5e-3])  # nor above 5 ms (a stall)

    def reads(pace: float, ready: float) -> int:  # status reads until one at or after ``ready`` (reads take no time)
        ends = accumulate(poll_sleeps(pace), initial=0.0) if not pace else accumulate(poll_sleeps(pace))
        return next(i for i, t in enumerate(ends, 1) if t >= ready)

    assert reads(0.0, 4e-3) == 6 and reads(4e-3, 4e-3) == 3

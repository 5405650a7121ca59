"""Network faults across simulated hosts: a host's cable pulled in the middle of a refit (``Host.partition``:
its end of the switch goes down, TCP stalls as on a real network), plugged back later. Each test runs under
a deadline; the bed kills every process and removes every namespace at the end, failed or not. After every
heal the next version commits everywhere, bit-exactly."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import anyio
import pytest

from tests.hosts._bed import Bed, Role, refit_all

DEADLINE_S = 300
CUT_S = 11.0  # every cut outlasts a registry lease (10 s): the cut-off ranks' leases expire before the heal


async def outlast(cut_at: float) -> None:
    """Keep the cable pulled until the cut made at ``cut_at`` (``time.monotonic``) has lasted ``CUT_S``."""
    await anyio.sleep(max(0.0, cut_at + CUT_S - time.monotonic()))


async def committed_everywhere(trainer: Role, ranks: list[Role], version: int) -> None:
    assert (await trainer.ask({"version": version, "seed": version}))["late"] == []
    outcomes = await refit_all(ranks, version, timeout=60)
    assert all(o["committed"] and o["version"] == version for o in outcomes), outcomes
    for rank in ranks:
        assert (await rank.ask({"holds": version}))["holds"], rank.host.name


async def outcomes_of(ranks: list[Role]) -> list[dict[str, Any]]:
    """The outcome of each rank's refit (already sent), in order; notices before it (``pulling``) skipped."""
    out: list[dict[str, Any]] = [{}] * len(ranks)

    async def one(i: int) -> None:
        while "committed" not in (answer := await ranks[i].next()):
            pass
        out[i] = answer

    async with anyio.create_task_group() as tg:
        for i in range(len(ranks)):
            tg.start_soon(one, i)
    return out


async def two_engines(bed: Bed) -> tuple[Role, list[Role], list[Role]]:
    trainer = await bed.trainer()
    a = await bed.engine("a", ["inf1", "inf1"], port=7201)
    b = await bed.engine("b", ["inf2", "inf2"], port=7301)
    await committed_everywhere(trainer, [*a, *b], 1)
    return trainer, a, b


@pytest.mark.asyncio
async def test_an_inference_host_cut_off_mid_refit_fails_its_engine_alone_and_commits_once_healed(
    tmp_path: pathlib.Path,
) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1", "inf2"]) as bed:
            trainer, a, b = await two_engines(bed)
            await trainer.ask({"version": 2, "seed": 2})
            for rank in b:
                await rank.send({"refit": 2, "timeout": 30, "slow_pull": 2.0})
            assert [await rank.next() for rank in b] == [{"pulling": True}] * 2
            bed.hosts["inf2"].partition()
            cut_at = time.monotonic()
            assert all(o["committed"] for o in await refit_all(a, 2)), "the engine on the other host"
            for o in await outcomes_of(b):
                assert not o["committed"] and o["fence"] == "ready", o  # shadow: version 1 serves on
            for rank in b:
                assert (await rank.ask({"holds": 1}))["holds"]
            await outlast(cut_at)
            bed.hosts["inf2"].heal()
            await committed_everywhere(trainer, [*a, *b], 3)


@pytest.mark.asyncio
async def test_the_trainer_host_cut_off_mid_refit_fails_every_engine_and_the_next_version_commits_once_healed(
    tmp_path: pathlib.Path,
) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1", "inf2"]) as bed:
            trainer, a, b = await two_engines(bed)
            await trainer.ask({"version": 2, "seed": 2})
            for rank in [*a, *b]:  # each holds 6 s after its first bucket: the cut comes while all hold
                await rank.send({"refit": 2, "timeout": 30, "slow_pull": 6.0})
            assert [await rank.next() for rank in [*a, *b]] == [{"pulling": True}] * 4
            bed.hosts["trainer"].partition()
            cut_at = time.monotonic()
            for o in await outcomes_of([*a, *b]):
                assert not o["committed"] and o["fence"] == "ready", o
            for rank in [*a, *b]:
                assert (await rank.ask({"holds": 1}))["holds"]
            await outlast(cut_at)
            bed.hosts["trainer"].heal()
            await committed_everywhere(trainer, [*a, *b], 3)


@pytest.mark.asyncio
async def test_the_registry_host_cut_off_for_20_s_while_engines_wait_and_the_trainer_publishes(
    tmp_path: pathlib.Path,
) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1", "inf2"]) as bed:
            trainer, a, b = await two_engines(bed)
            bed.hosts["reg"].partition()
            for rank in [*a, *b]:
                await rank.send({"refit": 2, "timeout": 90})  # waiting for version 2, the registry unreachable
            await trainer.send({"version": 2, "seed": 2})
            published = await trainer.next()  # unanswered: held by the trainer's client, announced once healed
            assert published["published"] == 2 and len(published["late"]) == 2, published
            assert "will be announced when the registry answers again" in published["late"][0]
            await anyio.sleep(20.0)
            bed.hosts["reg"].heal()
            outcomes = await outcomes_of([*a, *b])
            assert all(o["committed"] and o["version"] == 2 for o in outcomes), outcomes
            for rank in [*a, *b]:
                assert (await rank.ask({"holds": 2}))["holds"]
            await committed_everywhere(trainer, [*a, *b], 3)


@pytest.mark.asyncio
async def test_readers_of_a_relay_whose_host_is_cut_off_reroute_to_the_trainer_and_commit(
    tmp_path: pathlib.Path,
) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1", "inf2"]) as bed:
            trainer, a, b = await two_engines(bed)
            await trainer.ask({"version": 2, "seed": 2})
            assert all(o["committed"] for o in await refit_all(a, 2))  # engine a relays version 2
            before = (await trainer.ask({"served": True}))["served"]
            for rank in b:
                await rank.send({"refit": 2, "timeout": 60, "slow_pull": 2.0})
            assert [await rank.next() for rank in b] == [{"pulling": True}] * 2
            bed.hosts["inf1"].partition()  # the relays' host
            cut_at = time.monotonic()
            outcomes = await outcomes_of(b)
            assert all(o["committed"] and o["version"] == 2 for o in outcomes), outcomes
            for rank in b:
                assert (await rank.ask({"holds": 2}))["holds"]
            assert (await trainer.ask({"served": True}))["served"] > before  # what the relays owed, rerouted
            await outlast(cut_at)
            bed.hosts["inf1"].heal()
            await committed_everywhere(trainer, [*a, *b], 3)


@pytest.mark.asyncio
async def test_a_rank_cut_off_after_it_voted_is_in_doubt_nobody_serves_a_split_and_it_learns_the_verdict(
    tmp_path: pathlib.Path,
) -> None:
    """Engine ``c``'s rank 1 sits on a host of its own. It sends its ballot and is cut off before the verdict:
    rank 0 (the vote's coordinator) commits; rank 1 is in doubt, serving nothing (fence ``updating``), its
    version prepared and unseen. Healed, its next refit learns COMMIT from rank 0 first, then both commit."""
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1", "inf3"]) as bed:
            trainer = await bed.trainer()
            c = await bed.engine("c", ["inf1", "inf3"], port=7401)
            await committed_everywhere(trainer, c, 1)
            await trainer.ask({"version": 2, "seed": 2})
            assert await c[1].ask({"pause_after_ballot": True}) == {"armed": True}
            for rank in c:
                await rank.send({"refit": 2, "timeout": 30})
            assert await c[1].next() == {"voted": 2}
            bed.hosts["inf3"].partition()
            cut_at = time.monotonic()
            zero, one = await outcomes_of(c)
            assert zero["committed"] and zero["version"] == 2, zero
            assert not one["committed"] and one["in_doubt"] is not None and one["fence"] == "updating", one
            assert (await c[0].ask({"holds": 2}))["holds"]
            held = await c[1].ask({"holds": 1})  # the prepared version is not visible; the rank does not serve
            assert held["holds"] and held["committed_version"] == 1 and held["fence"] == "updating", held
            await outlast(cut_at)
            bed.hosts["inf3"].heal()
            await committed_everywhere(trainer, c, 3)

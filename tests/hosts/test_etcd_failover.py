"""The control plane on a real 3-member etcd cluster, each member on a host of its own, two registry replicas
on two more hosts, a trainer and an engine of two ranks: the etcd leader killed mid-publish and mid-refit,
a registry replica killed mid-refit, one etcd member cut off, the whole cluster restarted. Every client is
given both replicas. Each test runs under a deadline; after each fault the refit in flight commits (or
fails cleanly) and the next version commits everywhere, bit-exactly; nothing committed is lost and no
version is published twice (the trainer's publishes never meet "other content")."""

from __future__ import annotations

import pathlib

import anyio
import pytest

from tests.hosts._bed import Bed, Role, refit_all
from tests.hosts.test_partitions import committed_everywhere, outcomes_of

DEADLINE_S = 300


async def fleet(bed: Bed) -> tuple[Role, list[Role]]:
    trainer = await bed.trainer()
    ranks = await bed.engine("a", ["inf1", "inf1"], port=7201)
    await committed_everywhere(trainer, ranks, 1)
    return trainer, ranks


async def publish(trainer: Role, version: int) -> None:
    """Publish ``version``: every rank's publish answered in time (through some replica), none refused."""
    answer = await trainer.ask({"version": version, "seed": version})
    assert answer["late"] == [], answer


async def refit_under(ranks: list[Role], version: int, fault: object) -> list[dict[str, object]]:
    """Start a slow refit of ``version`` on every rank, call ``fault()`` once every rank is pulling, return the
    outcomes."""
    for rank in ranks:
        await rank.send({"refit": version, "timeout": 60, "slow_pull": 3.0})
    assert [await rank.next() for rank in ranks] == [{"pulling": True}] * len(ranks)
    await anyio.to_thread.run_sync(fault)  # type: ignore[arg-type]
    return await outcomes_of(ranks)


@pytest.mark.asyncio
async def test_the_etcd_leader_killed_mid_publish_and_mid_refit(tmp_path: pathlib.Path) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1"], etcd=3, replicas=2) as bed:
            assert bed.etcd is not None
            trainer, ranks = await fleet(bed)
            leader = bed.etcd.leader()
            bed.etcd.kill(leader)
            await publish(trainer, 2)  # at once: it lands while the other two elect a new leader (≥ 1 s)
            outcomes = await refit_all(ranks, 2, timeout=60)
            assert all(o["committed"] and o["version"] == 2 for o in outcomes), outcomes
            bed.etcd.start(leader)  # back on its data folder, it rejoins as a follower
            await publish(trainer, 3)
            second = bed.etcd.leader()
            outcomes = await refit_under(ranks, 3, lambda: bed.etcd.kill(second))  # type: ignore[union-attr]
            assert all(o["committed"] and o["version"] == 3 for o in outcomes), outcomes
            bed.etcd.start(second)
            await committed_everywhere(trainer, ranks, 4)


@pytest.mark.asyncio
async def test_a_registry_replica_killed_mid_refit(tmp_path: pathlib.Path) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1"], etcd=3, replicas=2) as bed:
            trainer, ranks = await fleet(bed)
            await publish(trainer, 2)
            outcomes = await refit_under(ranks, 2, lambda: bed.kill_registry(0))  # the replica every client used
            assert all(o["committed"] and o["version"] == 2 for o in outcomes), outcomes
            await committed_everywhere(trainer, ranks, 3)  # through the other replica alone
            await bed.start_registry(0)
            await committed_everywhere(trainer, ranks, 4)


@pytest.mark.asyncio
async def test_one_etcd_member_cut_off_mid_refit(tmp_path: pathlib.Path) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1"], etcd=3, replicas=2) as bed:
            assert bed.etcd is not None
            trainer, ranks = await fleet(bed)
            await publish(trainer, 2)
            leader = bed.etcd.leader()
            host = next(h for h in bed.hosts.values() if h.address == leader.host)
            outcomes = await refit_under(ranks, 2, host.partition)  # the leader itself: the rest elect another
            assert all(o["committed"] and o["version"] == 2 for o in outcomes), outcomes
            await committed_everywhere(trainer, ranks, 3)  # the majority serves on
            host.heal()
            await committed_everywhere(trainer, ranks, 4)


@pytest.mark.asyncio
async def test_the_whole_etcd_cluster_restarted(tmp_path: pathlib.Path) -> None:
    with anyio.fail_after(DEADLINE_S):
        async with Bed(tmp_path, ["trainer", "inf1"], etcd=3, replicas=2) as bed:
            assert bed.etcd is not None
            trainer, ranks = await fleet(bed)
            await publish(trainer, 2)
            for member in bed.etcd.members:
                bed.etcd.kill(member)
            await anyio.sleep(2.0)
            bed.etcd.start()
            await anyio.to_thread.run_sync(bed.etcd.leader)
            outcomes = await refit_all(ranks, 2, timeout=60)  # version 2 was committed to etcd: not lost
            assert all(o["committed"] and o["version"] == 2 for o in outcomes), outcomes
            await committed_everywhere(trainer, ranks, 3)

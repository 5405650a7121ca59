"""Refits across simulated hosts (``_netns``: one network namespace per host, cabled to one switch): the
registry on one host, a trainer with two Megatron publisher ranks on another, two TP-2 engines on two more.
Bytes move by NIXL over TCP between hosts — checked in UCX's own account of what it chose — and the engine
on the second host reads from the first one's relays."""

from __future__ import annotations

import pathlib

import anyio
import pytest

from tests.hosts._bed import Bed, refit_all


@pytest.mark.asyncio
async def test_two_engines_on_two_hosts_refit_bit_exactly_over_tcp_and_relay_across_hosts(
    tmp_path: pathlib.Path,
) -> None:
    with anyio.fail_after(240):
        async with Bed(tmp_path, ["trainer", "inf1", "inf2"]) as bed:
            trainer = await bed.trainer()
            a = await bed.engine("a", ["inf1", "inf1"], port=7201)
            b = await bed.engine("b", ["inf2", "inf2"], port=7301)
            await trainer.ask({"version": 1, "seed": 1})
            assert all(o["committed"] and o["version"] == 1 for o in await refit_all(a, 1)), "engine a"
            egress = (await trainer.ask({"served": True}))["served"]
            assert egress > 0
            assert all(o["committed"] and o["version"] == 1 for o in await refit_all(b, 1)), "engine b"
            # engine b read from engine a's relays on the other host; from the trainer only the pieces whose digest
            # tiles its small buckets split (never relayed: docs/fanout.md)
            assert (await trainer.ask({"served": True}))["served"] - egress < egress / 4
            for rank in [*a, *b]:
                assert (await rank.ask({"holds": 1}))["holds"]

            await trainer.ask({"version": 2, "seed": 2})  # both engines at once: pipelined fan-out
            outcomes = await refit_all([*a, *b], 2)
            assert all(o["committed"] and o["version"] == 2 for o in outcomes), outcomes
            for rank in [*a, *b]:
                assert (await rank.ask({"holds": 2}))["holds"]
            assert (await trainer.ask({"served": True}))["served"] < 3 * egress  # not a copy per engine

            # every transport UCX chose, in every process, for every peer: TCP on the host's own cable (UCX calls
            # peers on one kernel "intra-node" whatever their namespace: only the transport tells)
            choices = bed.ucx_choices()
            assert {c for c in choices if "/" in c} == {"tcp/eth0"} and "inter-node" in choices, choices

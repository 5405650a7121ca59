"""A READ nobody waits for any longer still lands: the transport sees it to its end before its memory is reused.

Real NIXL over TCP (``UCX_TLS=tcp``: over cma a reader copies the bytes itself and a READ never waits for its
peer), a publisher in its own process (``_nixl_peer``) stopped with SIGSTOP — a peer that stopped answering,
as behind a network partition — while a READ of it is on the wire. NIXL cannot cancel that READ: once the peer
answers, its bytes land. Before this was known, a refit abandoned such a READ and forgot the peer (after which
NIXL can no longer tell when the READ ends), and the next attempt's bytes were overwritten by the late ones
(CI, 2026-12-05: ``test_an_inference_host_cut_off_mid_refit...`` failed verification after the heal).
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest
import torch
from _nixl_peer import Peer, model

from refitflow.core.errors import TransportError
from refitflow.transports._nixl_agent import dead_peer_config
from refitflow.transports.base import Read, as_bytes, settle_or_abandon
from refitflow.transports.nixl import NixlTransport

SPEC = {"tensors": 1, "numel": 4 << 20, "model": "orphans"}
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


@pytest.mark.asyncio
async def test_an_abandoned_read_is_seen_to_its_end_before_its_memory_is_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)  # read when this process's NIXL agent is made
    expected = as_bytes(model(SPEC, 5)["layers.0.weight"])
    landing = torch.zeros_like(expected)
    peer = Peer(SPEC)
    peer.env = TCP
    with anyio.fail_after(90):
        async with peer:
            manifest = await peer.publish(1, 5)
            shard = manifest.shards[0]
            transport = NixlTransport()
            try:
                transport.connect(manifest.source)
                transport.register(landing)
                reads = [Read(manifest.source.agent, shard.region, shard.offset, expected.numel(), landing)]
                await transport.read(reads)  # connected, and the bytes are right
                assert torch.equal(landing, expected)
                landing.zero_()

                assert peer.proc is not None
                os.kill(peer.proc.pid, signal.SIGSTOP)  # the peer stops answering
                try:
                    posted = await transport.submit(reads)
                    await settle_or_abandon([posted], 0.5)  # a deadline passed: nobody waits any longer
                    assert not posted.landed()
                    transport.reconnect([manifest.source.agent])  # as a failed pull asks: connect afresh
                    with pytest.raises(TransportError, match="abandoned read"):
                        await transport.quiesce(0.2)  # still on the wire: its memory is not to be reused
                    assert not landing.any()
                finally:
                    os.kill(peer.proc.pid, signal.SIGCONT)
                await transport.quiesce(30)  # returns once the abandoned READ ended: its bytes are in
                assert torch.equal(landing, expected)

                landing.zero_()  # the next read connects afresh (the drop waited for the READ) and lands
                await transport.read(reads)
                assert torch.equal(landing, expected)
            finally:
                await transport.aclose()


def test_a_peer_that_stops_answering_fails_its_reads_within_dead_peer_s() -> None:
    """The settings NIXL's UCX backend is made with (its ``engine_config``); that they take effect — a READ posted
    into a network partition fails in about ``dead_peer_s`` instead of never — is what ``tests/hosts`` shows
    (``test_partitions.py``: a relay's readers reroute before their read deadline)."""
    assert dead_peer_config(5.0) == "TCP_USER_TIMEOUT=5s,TCP_KEEPIDLE=2s,TCP_KEEPINTVL=1s,TCP_KEEPCNT=3"
    assert dead_peer_config(0.1) == "TCP_USER_TIMEOUT=2s,TCP_KEEPIDLE=1s,TCP_KEEPINTVL=1s,TCP_KEEPCNT=1"
    assert dead_peer_config(None) == ""  # UCX's own, and the environment's UCX_TCP_* settings

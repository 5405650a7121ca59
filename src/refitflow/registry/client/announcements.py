"""A registry client's subscription to the registry's announcements (its PUB socket).

The registry announces a version on the identity's topic when it becomes the newest complete (or laid
out) one; waiters wake on ``event`` and ask again. The SUB socket is connected on first use, to the
address the registry's ``hello`` names (reached the way the client reaches the registry), moved when a
restarted registry announces elsewhere (subscriptions carry over). With replicas, it is connected to every
replica that answers a ``hello`` (``everywhere``; every replica announces every version: its store's watch),
so a waiter hears of a version from the survivors while the replica it asks is dead.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from refitflow.core.errors import RefitError
from refitflow.core.types import Identity
from refitflow.registry.client.channel import Channel
from refitflow.registry.messages import topic

__all__ = ["Announcements"]


class Announcements:
    def __init__(self, channel: Channel) -> None:
        self._channel = channel  # whose context and tasks the SUB socket shares
        self._sub: zmq.asyncio.Socket | None = None
        self._sub_at: dict[str, str] = {}  # replica address -> where it announces
        self._subscribed: set[bytes] = set()
        self._asking: set[str] = set()  # replicas whose ``hello`` is being asked (``everywhere``)
        self.event = asyncio.Event()  # set at the next announcement (a fresh one after each)
        self.count = 0  # announcements received

    def subscribe(self, pub: str, identities: list[Identity], via: str) -> None:
        """Listen on ``pub`` (the ``hello`` of the registry at ``via``) for ``identities``' announcements."""
        if via.startswith("tcp://") and pub.startswith("tcp://"):  # reach it the way we reach the ROUTER
            pub = f"{via.rsplit(':', 1)[0]}:{pub.rsplit(':', 1)[1]}"
        if self._sub is None:
            self._sub = self._channel.socket(zmq.SUB)
            self._channel.spawn(self._read(self._sub))
        old = self._sub_at.get(via)
        if pub != old:  # a replica new to us, or a restarted one announcing elsewhere (subscriptions carry over)
            if old is not None:
                self._sub.disconnect(old)
            self._sub.connect(pub)
            self._sub_at[via] = pub
        for identity in identities:
            if topic(identity) not in self._subscribed:
                self._sub.setsockopt(zmq.SUBSCRIBE, topic(identity))
                self._subscribed.add(topic(identity))

    def everywhere(self, channels: list[Channel]) -> None:
        """Listen to every replica's announcements too: ask each one not listened to yet for its ``hello`` (in
        the background; one that does not answer is asked again at the next call)."""
        for channel in channels:
            if channel.address not in self._sub_at and channel.address not in self._asking:
                self._asking.add(channel.address)
                channel.spawn(self._listen(channel))

    async def _listen(self, channel: Channel) -> None:
        try:
            hello = await channel.request("hello")
            self.subscribe(str(hello["pub"]), [], channel.address)
        except RefitError:
            pass  # down (or refusing us): the waiter asks the replicas in turn meanwhile
        finally:
            self._asking.discard(channel.address)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            await sock.recv_multipart()
            self.count += 1
            self.event.set()
            self.event = asyncio.Event()

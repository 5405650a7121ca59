"""A process for ``test_registry_flood``, inside a simulated host. ``flood ADDRESS N``: registers a receiver
that never reports, then opens N sockets to the registry, each sending 200 ``wait_released`` long polls
(held by the registry 30 s each, or answered "busy"), prints ``{"flooding": true}`` and holds on.
``ask ADDRESS``: a legitimate client's ``hello`` and ``register_receiver``; prints whether it was served."""

from __future__ import annotations

import asyncio
import json
import sys

import orjson
import zmq
import zmq.asyncio

import refitflow as rf
from refitflow.core.wire import PROTOCOL_VERSION
from refitflow.registry.client.client import RegistryClient

IDENTITY = {"model": "flood"}


async def flood(address: str, sockets: int) -> None:
    ctx = zmq.asyncio.Context()
    first = ctx.socket(zmq.DEALER)
    first.connect(address)
    await first.send(orjson.dumps({"v": PROTOCOL_VERSION, "id": 0, "op": "register_receiver", "identity": IDENTITY,
                                   "receiver_id": "never-reports"}))  # fmt: skip
    await first.recv()
    for _ in range(sockets):
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        for k in range(200):
            await sock.send(orjson.dumps({"v": PROTOCOL_VERSION, "id": k, "op": "wait_released", "version": 1,
                                          "identity": IDENTITY, "wait_s": 30.0}))  # fmt: skip
    await asyncio.sleep(2.0)  # every request delivered: held, or answered busy
    print(json.dumps({"flooding": True}), flush=True)
    await asyncio.sleep(60)


async def ask(address: str) -> None:
    async with RegistryClient(address, request_timeout_s=5) as client:
        try:
            await client.hello()
            await client.register_receiver(rf.Identity(model="legit"), "r")
            print(json.dumps({"served": True}), flush=True)
        except rf.RefitError as exc:
            print(json.dumps({"served": False, "why": str(exc)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "flood":
        asyncio.run(flood(sys.argv[2], int(sys.argv[3])))
    else:
        asyncio.run(ask(sys.argv[2]))

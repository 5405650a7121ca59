"""A request frame decoded without stopping the registry's event loop for long, its size checked first.

Only the frame's JSON is counted and parsed this way: bytes carried beside it (``core.wire.Blob``: digests) are
not JSON — each blob is a ``memoryview`` of the frame where its reference was, its size checked by whoever
reads it, before anything is read from it.

A small frame (≤ ``SMALL_BYTES``) is decoded at once (orjson: well under a millisecond). A larger one is
first counted — its JSON values (a ``,`` before each but the first of a list or object), a slice at a
time — and refused past what the row limit allows (``VALUES_PER_ROW`` values a shard spec or relay row,
whether rows or columns carry them) before anything is built; then decoded by a streaming parser
(ijson's C backend) fed ``STEP_BYTES`` at a time, yielding to the loop between feeds, so other clients'
requests (and heartbeats) are served meanwhile. A one-shot decode of a 67 MB frame held the interpreter
for 3.1 s (measured here), and every other client with it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ijson

from refitflow.core.errors import ManifestError
from refitflow.core.wire import split_frame, with_blobs
from refitflow.registry.messages import check_message, decode_message

__all__ = ["ROW_SLACK", "decode_request"]

SMALL_BYTES = 1 << 18
STEP_BYTES = 1 << 15  # one feed of the streaming parser: ≈ 2 ms of work
SCAN_BYTES = 1 << 23  # one slice of the row count: ≈ 6 ms
ROW_SLACK = 1024  # rows of the envelope and of fields other than the rows themselves
VALUES_PER_ROW = 16  # a shard spec has 15 fields (a relay offer's rows fewer); its shape is a list of a few


async def decode_request(body: bytes, max_rows: int) -> dict[str, Any]:
    head, tail = split_frame(body)
    msg = await _decode_json(bytes(head) if tail is not None else body, max_rows)
    return msg if tail is None else dict(with_blobs(msg, tail))


async def _decode_json(body: bytes, max_rows: int) -> dict[str, Any]:
    if len(body) <= SMALL_BYTES:
        return decode_message(body)
    values, most = 0, (max_rows + ROW_SLACK) * VALUES_PER_ROW
    for at in range(0, len(body), SCAN_BYTES):
        values += body.count(b",", at, min(len(body), at + SCAN_BYTES))
        if values > most:
            raise ManifestError(f"a request of more than {values} JSON values, over what the registry's limit of "
                                f"{max_rows} shard specs holds (refused before decoding)")  # fmt: skip
        await asyncio.sleep(0)
    found = ijson.sendable_list()
    parser = ijson.items_coro(found, "", use_float=True)
    view = memoryview(body)
    try:
        for at in range(0, len(body), STEP_BYTES):
            parser.send(bytes(view[at : at + STEP_BYTES]))
            await asyncio.sleep(0)
        parser.close()
    except ijson.JSONError as exc:
        raise ManifestError(f"a request frame is not valid JSON: {exc}") from None
    if len(found) != 1:
        raise ManifestError("a request frame holds one JSON value")
    return check_message(found[0])

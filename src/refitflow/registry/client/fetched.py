"""A registry client's publications already fetched: one fetch per (identity, version, revisions), LRU.

``latest`` answers with a version and its manifests' revisions only; the manifests themselves are fetched
once (concurrent askers share the fetch), validated off the event loop, and kept for ``size`` versions.
A version announced before its digests has revisions "": fetched each time it is asked for while laid out
(never kept), then once complete.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from refitflow.core.errors import VersionError
from refitflow.core.types import Publication
from refitflow.core.wire import manifest_from_dict

__all__ = ["Fetched"]


class Fetched:
    def __init__(self, request: Callable[..., Awaitable[Any]], size: int) -> None:
        self._request = request
        self._size = size
        self._cache: OrderedDict[tuple[Any, ...], Publication] = OrderedDict()
        self._fetching: dict[tuple[Any, ...], asyncio.Future[Publication]] = {}
        self.fetches = 0  # manifest fetches (for tests and benches: one per new version)

    async def get(self, found: dict[str, Any]) -> Publication:
        """The publication ``latest`` found (``{"identity", "version", "revisions"}``)."""
        key = (tuple(sorted(found["identity"].items())), found["version"], tuple(found["revisions"]))
        pub = self._cache.get(key)
        if pub is None:
            fetching = self._fetching.get(key)
            if fetching is None:  # one fetch per version, however many ask at once
                fetching = self._fetching[key] = asyncio.ensure_future(
                    self._fetch(found["identity"], found["version"], early=not all(found["revisions"]))
                )
                fetching.add_done_callback(lambda _: self._fetching.pop(key, None))
            pub = await asyncio.shield(fetching)
            if pub.pending:  # not kept: revisions "" do not tell a re-announcement (a new address) apart
                return pub
            self._cache[key] = pub
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return pub

    def cancel(self) -> None:
        """Cancel the fetches under way (the client closes)."""
        for fetching in self._fetching.values():
            fetching.cancel()

    async def _fetch(self, identity: dict[str, str], version: int, *, early: bool) -> Publication:
        dicts = await self._request("manifests", identity=identity, version=version, early=early)
        self.fetches += 1
        # validating thousands of shard specs is CPU work: off the event loop, which keeps serving
        manifests = await asyncio.to_thread(lambda: tuple(manifest_from_dict(d) for d in dicts))
        if not manifests:
            raise VersionError("the registry returned no manifests", version=version)
        return Publication(identity=manifests[0].identity, version=version, manifests=manifests)

"""The trainer of the engine integration tests: the Megatron-layout publisher process and its registry."""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Self

from tests.transports._nixl_peer import LineChild

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


class Trainer(LineChild):
    """The Megatron-layout publisher process (``_megatron_publisher``) and the registry it serves."""

    def __init__(self, kind: str, tp: int = 2, ep: int = 1) -> None:
        spec = json.dumps({"kind": kind, "tp": tp, "ep": ep})
        super().__init__([sys.executable, "-m", "tests.integrations._megatron_publisher", spec], path=[ROOT])

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self.registry = str((await self._ask(None))["registry"])
        return self

    async def publish(self, version: int, seed: int, corrupt: int | None = None) -> None:
        assert await self._ask({"version": version, "seed": seed, "corrupt": corrupt}) == {"published": version}

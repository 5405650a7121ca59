"""The vLLM tests: UCX on loopback for NIXL (set before nixl is first imported)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")

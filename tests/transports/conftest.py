"""Transport tests: keep UCX on loopback (the library itself never reads or sets the environment)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before nixl (UCX) is first imported

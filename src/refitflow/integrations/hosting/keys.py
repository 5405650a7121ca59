"""The one place an integration reads its environment: where the deployment's CURVE keys are, and whether a
server joins a running fleet (``REFITFLOW_JOIN``, ``join_setting``; docs/fleet.md).

Every integration (vLLM's worker and trainer sides, SGLang, verl) turns CURVE on for its registry
client, its vote and its embedded registry with the keys found here (``REFITFLOW_KEYS``, else
``~/.refitflow/keys``), presenting its role's pair: ``trainer`` on the trainer side, ``rollout`` in an
inference server (a folder made before roles: its single ``client`` pair); ``REFITFLOW_KEYS=open`` runs
open, logged as a warning; no keys at all is a ``ConfigError`` saying how to make them.
"""

from __future__ import annotations

import os
from pathlib import Path

from refitflow.registry.keys import DeploymentKeys, find_keys

__all__ = ["JOIN_ENV", "deployment_keys", "join_setting"]

JOIN_ENV = "REFITFLOW_JOIN"


def deployment_keys(role: str | None = None) -> DeploymentKeys | None:
    """This process's deployment keys, presenting ``role``'s pair; None when it was told to run open
    (``REFITFLOW_KEYS=open``)."""
    return find_keys(os.environ, Path.home(), role)


def join_setting() -> str | None:
    """``REFITFLOW_JOIN``: this server joins a running fleet (vLLM: the init and update info as JSON; SGLang:
    any value), or None."""
    return os.environ.get(JOIN_ENV) or None

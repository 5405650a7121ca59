"""The test session's CURVE key set, made once per session in a private temporary folder and named by
``REFITFLOW_KEYS`` for every process the tests start (the integrations and ``refitflow registry`` find it
there, as a deployment's would): tests serve registries with ``KEYS.server`` and connect with ``KEYS.client``.

The folder holds a pair per role (trainer, rollout, operator: what ``refitflow keys`` makes, and what the
integrations present) and the single ``client`` pair of a folder made before roles (every role), which the tests
that speak for several roles at once present as ``KEYS.client``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from refitflow.registry.keys import DeploymentKeys

__all__ = ["KEYS", "drop_session_keys"]

_MADE_HERE = "REFITFLOW_KEYS" not in os.environ


def _session_keys() -> DeploymentKeys:
    if not _MADE_HERE:
        return DeploymentKeys.load(Path(os.environ["REFITFLOW_KEYS"]))
    keys = DeploymentKeys.create(Path(tempfile.mkdtemp(prefix="refitflow-test-keys-")),
                                 ("trainer", "rollout", "operator", "client"))
    os.environ["REFITFLOW_KEYS"] = str(keys.folder)
    return keys


KEYS = _session_keys()


def drop_session_keys() -> None:
    if _MADE_HERE:
        shutil.rmtree(KEYS.folder, ignore_errors=True)

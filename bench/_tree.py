"""An earlier refitflow's source tree, for benches that compare against it in the same run."""

from __future__ import annotations

import pathlib
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from io import BytesIO

ROOT = pathlib.Path(__file__).resolve().parents[1]


@contextmanager
def source_of(commit: str) -> Iterator[pathlib.Path]:
    """``commit``'s ``src`` folder (``git archive``), in a temporary directory: put it first on PYTHONPATH."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], check=True, capture_output=True)
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        yield pathlib.Path(tmp) / "src"

"""The public names stay what docs/architecture.md says they are."""

import pathlib
import re

import refitflow as rf

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_public_names_match_the_docs() -> None:
    section = DOC.read_text().split("## Public API", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([A-Za-z_]+)`", section))
    assert documented == set(rf.__all__)
    assert all(hasattr(rf, name) for name in rf.__all__)


def test_every_error_derives_from_refit_error() -> None:
    errors = [getattr(rf, n) for n in rf.__all__ if n.endswith("Error")]
    assert len(errors) >= 9 and all(issubclass(e, rf.RefitError) for e in errors)
    assert issubclass(rf.RefitTimeoutError, TimeoutError)

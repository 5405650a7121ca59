"""The integrations moved by role (hosting/, vllm/{worker,server,trainer,driver}/): every old module path still
imports — with a DeprecationWarning naming the new one — and is the very module at its new path."""

from __future__ import annotations

import importlib
import sys

import pytest

from refitflow.integrations._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_module_at_its_new_path(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        mod = importlib.import_module(old)
    assert mod is new
    assert mod.__spec__ is not None and mod.__spec__.name == MOVED[old]  # its own spec, not the alias's


def test_the_vllm_packages_names_come_from_their_roles() -> None:
    import refitflow.integrations.vllm as v
    from refitflow.integrations.hosting.info import RefitflowInitInfo
    from refitflow.integrations.vllm.driver import VllmFleet

    assert v.VllmFleet is VllmFleet and v.RefitflowInitInfo is RefitflowInitInfo
    with pytest.raises(AttributeError):
        v.NoSuchName  # noqa: B018

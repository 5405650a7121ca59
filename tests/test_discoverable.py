"""What a newcomer reads first documents every argument and option, and docs/registry.md every op."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib

import pytest

import refitflow as rf
from refitflow.registry.service.ops import Handler

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("cls", [rf.Publisher, rf.Receiver, rf.Registry, rf.Controller])
def test_main_classes_document_every_argument(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    assert len(doc.split()) >= 60, f"{cls.__name__} needs a docstring a newcomer can start from"
    init = cls.__init__
    params = [p for p in inspect.signature(init).parameters.values() if p.name != "self"]
    if cls is rf.Registry:  # an embedded store: its arguments come from RegistryStore
        params = [p for p in inspect.signature(rf.Registry).parameters.values() if p.name != "clock"]
    missing = [p.name for p in params if p.kind is not p.VAR_KEYWORD and f"``{p.name}``" not in doc]
    assert not missing, f"{cls.__name__}'s docstring does not explain {missing}"


def test_every_receiver_option_is_documented() -> None:
    doc = inspect.getdoc(rf.ReceiverConfig) or ""
    missing = [f.name for f in dataclasses.fields(rf.ReceiverConfig) if f"``{f.name}``" not in doc]
    assert not missing, f"rf.ReceiverConfig's docstring does not explain {missing}"


def test_registry_doc_lists_every_op() -> None:
    ops = sorted(name.removeprefix("op_") for name in dir(Handler) if name.startswith("op_"))
    text = (DOCS / "registry.md").read_text()
    missing = [op for op in ops if f"| `{op}` |" not in text]
    assert len(ops) >= 15 and not missing, f"docs/registry.md does not list the ops {missing}"

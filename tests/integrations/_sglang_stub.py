"""The one stub SGLang 0.5.23 needs on a CPU machine: ``torchvision``.

SGLang imports torchvision at module level (``sglang.srt.configs`` → its multimodal processors:
``import torchvision.transforms as T``), and torchvision's wheel does not load against the CPU build of
torch 2.13 that refitflow's CI uses, so it is not installed (``.ci/sglang-cpu.txt``). This puts a
module stub in its place — attribute lookups give empty placeholder classes, enough for those
module-level imports; no test path runs an image transform. transformers must see torchvision as
absent (it would import the real one), so its availability check runs, and is cached, first.
"""

from __future__ import annotations

import sys
import types


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def stub_torchvision() -> None:
    """Install the stub (idempotent); call before the first SGLang import."""
    if "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()  # cached: transformers never imports the stub
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules[name] = _Stub(name)
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]  # type: ignore[attr-defined]

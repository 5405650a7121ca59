"""refitflow imports vLLM's weight-transfer interface through ``integrations/vllm/weight_transfer.py`` and keeps
working with both of vLLM's layouts: ``vllm/distributed/weight_transfer/`` (0.32, 0.33: installed here) and
``vllm/backends/distributed/weight_transfer/`` (vLLM's newest code, whose old path is only a package forwarding
its exported names: its submodules are gone). The new layout is made in a child process by aliasing the
installed modules under the new names and removing the old submodules; the backend then registers with vLLM's
factory and the trainer engine with vLLM's trainer factory, through the new path only."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import vllm.distributed.weight_transfer.base as old_base

from refitflow.integrations.vllm import weight_transfer

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "refitflow"

NEW_LAYOUT = """
import sys, types, importlib
for sub in ("base", "factory", "clients"):
    importlib.import_module(f"vllm.distributed.weight_transfer.{sub}")
import vllm.distributed.weight_transfer as old
for name in ("vllm.backends", "vllm.backends.distributed"):
    pkg = types.ModuleType(name); pkg.__path__ = []; sys.modules[name] = pkg
sys.modules["vllm.backends.distributed.weight_transfer"] = old
for sub in ("base", "factory", "clients"):
    new = f"vllm.backends.distributed.weight_transfer.{sub}"
    sys.modules[new] = sys.modules[f"vllm.distributed.weight_transfer.{sub}"]
    sys.modules[f"vllm.distributed.weight_transfer.{sub}"] = None  # gone from the old path: importing it fails
try:
    importlib.import_module("vllm.distributed.weight_transfer.base")
    raise SystemExit("the old path's submodule still imports")
except ModuleNotFoundError:
    pass
from refitflow.integrations.vllm import weight_transfer
assert weight_transfer.ROOT == weight_transfer.NEW_ROOT, weight_transfer.ROOT
from refitflow.integrations.vllm.server.plugin import register
register()
register()  # vLLM runs its plugins more than once: still one registration
from refitflow.integrations.vllm.worker.backend import RefitflowEngine
from refitflow.integrations.vllm.trainer import RefitflowTrainerEngine, RefitflowTrainerInitInfo
factory = sys.modules["vllm.backends.distributed.weight_transfer.factory"]
base = sys.modules["vllm.backends.distributed.weight_transfer.base"]
assert issubclass(RefitflowEngine, base.WeightTransferEngine)
assert issubclass(RefitflowTrainerInitInfo, base.TrainerInitInfo)
assert issubclass(RefitflowTrainerEngine, base.TrainerWeightTransferEngine)
# (TRL 1.16 itself imports vllm.distributed.weight_transfer.nccl_common: TRL does not run on the new layout)
print("registered:", sorted(factory.WeightTransferEngineFactory._registry))
"""


def test_the_installed_vllm_is_imported_through_its_own_layout() -> None:
    assert weight_transfer.ROOT == weight_transfer.OLD_ROOT
    assert weight_transfer.WeightTransferEngine is old_base.WeightTransferEngine
    assert weight_transfer.submodule("base") is old_base


def test_vllms_new_layout_without_the_old_submodules_still_registers_the_backend() -> None:
    done = subprocess.run([sys.executable, "-c", NEW_LAYOUT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "'refitflow'" in done.stdout, done.stdout


def test_no_module_imports_vllms_weight_transfer_but_the_one_stable_path() -> None:
    wrong = []
    for path in SRC.rglob("*.py"):
        if path.name == "weight_transfer.py" and path.parent.name == "vllm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [f"{path.relative_to(SRC)}: {n}" for n in names if n.startswith(weight_transfer.OLD_ROOT)]
    assert not wrong, wrong

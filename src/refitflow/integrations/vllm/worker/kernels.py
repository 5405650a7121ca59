"""Which of a vLLM model's layers a refit may write directly, and how the others are refit: through vLLM's
reload machinery.

vLLM runs ``quant_method.process_weights_after_loading(layer)`` on every layer with a quantisation method
once its weights are loaded. Where that step transforms them, the live parameter is not what the kernel
reads: vLLM's CPU backend moves every linear weight into a oneDNN handle and leaves an empty parameter
(and the LM head a packed copy beside its weight); its CPU MoE prepacks the experts in place; FP8, Marlin
and compressed-tensors repack; FlashInfer's MoE converts w13/w2 to a block-major layout. Writing such a
parameter changes nothing the model computes, or corrupts it.

``split`` decides once, at init, per layer:

- **direct**: the method is known to leave the weights as the kernel reads them on this platform
  (``DIRECT`` — unquantised linear and embedding methods and the Triton MoE on CUDA); its parameters are
  written like any other, in place or through a shadow copy;
- **reprocess**: anything else. The layer's *loading layout* — the parameters as vLLM created them before
  processing, which vLLM recorded for its own reloads (``record_metadata_for_reloading``) — becomes a set
  of staging tensors the receiver writes (never read by a kernel: the old version keeps serving while
  they fill). Once they are verified, ``process`` runs vLLM's own per-layer reload steps on a detached copy
  of the layer (its own tables, its own copy of the quantisation method): restore the loading layout, put
  the new bytes in, ``process_weights_after_loading`` — what vLLM's ``_layerwise_process`` does after its
  weight loaders ran, processed as at load (``AS_AT_LOAD``, where vLLM's own reload skips work a reload
  needs) — while the live layer serves on. At the commit ``install`` copies what it made into the kernel's
  existing tensors (pointers never change: captured CUDA graphs stay valid) and moves over the attributes
  processing set (the CPU backend's oneDNN handle closure): microseconds, not a processing pass.

Layers without a quantisation method (norms) are direct. ``StorageWatch`` then checks, after every
commit, that each parameter and buffer of the model is still the storage it was at init.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refitflow.core.errors import ConfigError

__all__ = [
    "AS_AT_LOAD",
    "DIRECT",
    "KernelLayer",
    "Processed",
    "Split",
    "StorageWatch",
    "as_at_load",
    "install",
    "process",
    "quantised_layers",
    "recorded",
    "split",
]

# a quantisation method's state that makes its processing skip work on a reload: set aside while a layer is
# reprocessed, so the tensors are transformed as at load (vLLM 0.32 skips the CPU MoE prepack on a reload
# when ``moe_kernel`` is set: its own layerwise reload of the checkpoint it booted from changes w13/w2), then
# put back with the rest of the method's state
AS_AT_LOAD = ("moe_kernel",)
# (platform, quantisation method) whose processing leaves the weights as the kernel reads them; a MoE
# method also needs one of the backends listed (its kernel reads w13/w2 as loaded)
DIRECT: dict[tuple[str, str], frozenset[str] | None] = {
    ("cuda", "UnquantizedLinearMethod"): None,
    ("cuda", "UnquantizedEmbeddingMethod"): None,
    ("cuda", "UnquantizedFusedMoEMethod"): frozenset({"TRITON", "BATCHED_TRITON"}),
}


@dataclass(eq=False)
class KernelLayer:
    """A layer refit through vLLM's reload steps: its module and its loading-layout staging tensors."""

    name: str  # module name in the model
    module: torch.nn.Module
    method: str  # its quantisation method's class
    why: str  # why it is not written directly
    loading: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name (local) -> staging tensor

    def targets(self) -> Iterator[tuple[str, torch.Tensor]]:
        for local, tensor in self.loading.items():
            yield f"{self.name}.{local}", tensor


@dataclass(frozen=True)
class Split:
    direct: list[tuple[str, torch.Tensor]]  # the live parameters written directly
    layers: list[KernelLayer]  # the layers refit through vLLM's reload steps
    unloadable: dict[str, str]  # layers that need reprocessing and cannot have it -> why

    def targets(self) -> list[tuple[str, torch.Tensor]]:
        """What a receiver writes: the direct parameters and every reprocessed layer's staging tensors."""
        return [*self.direct, *(t for layer in self.layers for t in layer.targets())]

    def summary(self) -> str:
        """Which layers take which path, and why, in a few lines for vLLM's log."""
        by_why: dict[str, list[str]] = {}
        for layer in self.layers:
            by_why.setdefault(layer.why, []).append(layer.name)
        lines = [f"{len(self.direct)} parameters written directly (their layers' kernels read them as written)"]
        for why, names in by_why.items():
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            lines.append(f"{len(names)} layers reprocessed through vLLM's reload steps ({why}): "
                         f"{', '.join(names[:3])}{more}")  # fmt: skip
        for name, why in list(self.unloadable.items())[:5]:
            lines.append(f"cannot reprocess {name}: {why}")
        return "; ".join(lines)


def _platform() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_type", "") or "unknown")


LORA_BASE = ".base_layer"


def _method(module: torch.nn.Module) -> Any:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(module, "quant_method", None)
    return method if isinstance(method, QuantizeMethodBase) else None


def reads_as_written(method: Any, platform: str) -> bool:
    """Whether ``method``'s processing on ``platform`` leaves the weights as its kernel reads them."""
    key = (platform, type(method).__name__)
    if key not in DIRECT:
        return False
    backends = DIRECT[key]
    backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
    return backends is None or backend in backends


def _why(module: torch.nn.Module, method: Any, platform: str) -> str:
    emptied = [n for n, p in module.named_parameters(recurse=False) if p.numel() == 0]
    extra = f"; {emptied} emptied" if emptied else ""
    return f"{type(method).__name__} on {platform} transforms its weights after loading{extra}"


def _loading(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Staging tensors in the layer's loading layout: the parameters vLLM recorded before processing, and
    the ones it never moves to the meta device (``bias``), zero-filled (vocabulary padding stays zero)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    info = LAYERWISE_INFO.get(module)
    if info is None or not info.restore_metadata[0]:
        raise ConfigError("vLLM recorded no loading layout for it (record_metadata_for_reloading)")
    params, _ = info.restore_metadata
    device = next((t.device for t in module.parameters(recurse=False) if t.device.type != "meta"), info.restore_device)
    out = {name: torch.zeros(meta.shape, dtype=meta.dtype, device=device) for name, meta in params.items()}
    for name, p in module.named_parameters(recurse=False):  # bias: never on meta, the live one is its layout
        if name not in out and name not in SKIP_LOAD_TENSORS:
            out[name] = torch.zeros_like(p.detach())
    return out


def split(model: torch.nn.Module, *, reprocess_all: bool = False) -> Split:
    """Each layer's path (``reprocess_all``: every layer with a quantisation method is reprocessed)."""
    platform = _platform()
    direct: list[tuple[str, torch.Tensor]] = []
    layers: list[KernelLayer] = []
    unloadable: dict[str, str] = {}
    for module_name, module in model.named_modules():
        name = module_name.removesuffix(LORA_BASE)  # a LoRA wrapper's base layer, under the layer's own name
        method = None if _lora_wrapper(module) else _method(module)
        own = [(f"{name}.{n}" if name else n, p) for n, p in module.named_parameters(recurse=False)]
        if method is None or (not reprocess_all and reads_as_written(method, platform)):
            direct += own
            continue
        why = "reprocess_all asked for" if reprocess_all else _why(module, method, platform)
        try:
            layers.append(KernelLayer(name, module, type(method).__name__, why, _loading(module)))
        except ConfigError as exc:
            unloadable[name] = f"{why}, and {exc}"
    seen: set[int] = set()  # a tied parameter once (a tied LM head is the embedding)
    direct = [(n, p) for n, p in direct if not (id(p) in seen or seen.add(id(p)))]  # type: ignore[func-returns-value]
    return Split(direct=direct, layers=layers, unloadable=unloadable)


@contextlib.contextmanager
def as_at_load(methods: Iterable[Any]) -> Iterator[None]:
    """Process as at load: each method's ``AS_AT_LOAD`` state set aside while the body runs, then all of its
    state put back as it was (the kernel it built at load keeps reading the kernel tensors, which the
    processed values are copied into)."""
    kept = {id(m): (m, dict(vars(m))) for m in methods}
    try:
        for method, state in kept.values():
            for name in AS_AT_LOAD:
                if name in state:
                    setattr(method, name, None)
        yield
    finally:
        for method, state in kept.values():
            vars(method).clear()
            vars(method).update(state)


def quantised_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, Any]]:
    """Every layer with a quantisation method (what vLLM processes after loading), with it; a LoRA wrapper's base
    layer, not the wrapper (which answers with its base layer's method)."""
    return [(n, m, method) for n, m in model.named_modules()
            if not _lora_wrapper(m) and (method := _method(m)) is not None]  # fmt: skip


def _lora_wrapper(module: torch.nn.Module) -> bool:
    """vLLM's LoRA wrappers (``--enable-lora``) hold the layer they replaced as ``base_layer``: that one holds
    the weights and vLLM's recorded loading layout."""
    return isinstance(getattr(module, "base_layer", None), torch.nn.Module)


def recorded(model: torch.nn.Module) -> bool:
    """Whether vLLM recorded the model's loading layout (its loader did, ``record_metadata_for_reloading``):
    the layerwise reload needs it."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    layers = quantised_layers(model)
    return bool(layers) and all(m in LAYERWISE_INFO and LAYERWISE_INFO[m].restore_metadata[0] for _, m, _ in layers)


def _tensors(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return ({n: p for n, p in module._parameters.items() if p is not None},
            {n: b for n, b in module._buffers.items() if b is not None})  # fmt: skip


@dataclass(eq=False)
class Processed:
    """What vLLM's processing made of one layer's new loading-layout bytes, off to the side: its tensors, to be
    copied into the kernel's, and the attributes it set (a oneDNN handle's closure, say), to be moved over."""

    layer: KernelLayer
    tensors: dict[str, torch.Tensor]
    attributes: dict[str, Any]


def _detached(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` with its own attribute, parameter, buffer and submodule tables, and its own
    copy of the quantisation method: what processing changes on it stays off the live layer."""
    twin = module.__class__.__new__(module.__class__)
    twin.__dict__ = dict(module.__dict__)
    for table in ("_parameters", "_buffers", "_modules"):
        twin.__dict__[table] = dict(module.__dict__[table])
    twin.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    method: Any = copy.copy(module.quant_method)
    if isinstance(method, torch.nn.Module):
        method.__dict__ = dict(method.__dict__)
        for table in ("_parameters", "_buffers", "_modules"):
            method.__dict__[table] = dict(method.__dict__[table])
    for name in AS_AT_LOAD:  # processed as at load: state that skips work on a reload is left out
        if name in vars(method):
            vars(method)[name] = None
    if "quant_method" in twin._modules:  # a method that is a module is a submodule
        twin._modules["quant_method"] = method
    else:
        twin.__dict__["quant_method"] = method
    return twin


@torch.no_grad()
def process(layer: KernelLayer, staged: Mapping[str, torch.Tensor]) -> Processed:
    """vLLM's reload steps on a detached copy of ``layer`` with the bytes of ``staged`` (its loading-layout
    tensors holding the version): restore the loading layout, fill it, ``process_weights_after_loading``.
    Nothing live is touched: the engine goes on serving while it runs. Raises when processing fails or
    makes tensors the kernel's cannot take (another set of names, shapes or dtypes)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    module = layer.module
    kernel_params, kernel_buffers = _tensors(module)
    twin = _detached(module)
    info = LAYERWISE_INFO[module]
    restore_layer_on_meta(twin, info)
    materialize_layer(twin, info)
    for name, tensor in staged.items():
        current = getattr(twin, name)
        if current is kernel_params.get(name):  # never on meta (bias): the live one, so a fresh copy
            fresh = torch.nn.Parameter(tensor.clone(), requires_grad=False)
            fresh.__dict__.update(current.__dict__)
            twin._parameters[name] = fresh
        else:
            current.data.copy_(tensor)
    twin.__dict__.pop("_already_called_process_weights_after_loading", None)
    before = dict(twin.__dict__)
    method: Any = twin.quant_method
    method.process_weights_after_loading(twin)
    update: Any = getattr(twin, "update_param_tp_status", None)
    if update is not None:
        update()
    made_params, made_buffers = _tensors(twin)
    tensors: dict[str, torch.Tensor] = {}
    for name, kernel in {**kernel_params, **kernel_buffers}.items():
        made = made_params.get(name, made_buffers.get(name))
        if made is None:
            raise RuntimeError(f"{layer.name}: processing left no {name!r}, which the kernel holds")
        if made.shape != kernel.shape or made.dtype != kernel.dtype:
            raise RuntimeError(f"{layer.name}: processing made {name!r} {tuple(made.shape)} {made.dtype}, the kernel "
                               f"holds {tuple(kernel.shape)} {kernel.dtype}")  # fmt: skip
        tensors[name] = made.detach()
    tables = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "quant_method")
    attributes = {k: v for k, v in twin.__dict__.items()
                  if k not in tables and (k not in before or before[k] is not v)}  # fmt: skip
    return Processed(layer, tensors, attributes)


@torch.no_grad()
def install(processed: Processed) -> None:
    """Make a processed layer live: its tensors copied into the kernel's (their pointers never change), the
    attributes its processing set moved over. Microseconds for an attribute, a copy for each tensor."""
    module = processed.layer.module
    kernel_params, kernel_buffers = _tensors(module)
    for name, made in processed.tensors.items():
        kernel = kernel_params.get(name, kernel_buffers.get(name))
        assert kernel is not None
        if made.data_ptr() != kernel.data_ptr() and made.numel():
            kernel.data.copy_(made)
    for name, value in processed.attributes.items():
        module.__dict__[name] = value


class StorageWatch:
    """Where every parameter and buffer of a model sits; ``moved()`` names those that sit elsewhere now
    (replaced behind the receiver's back, or by a processing step that allocated): a captured CUDA graph,
    and any cached view, still reads the old storage. ≈ 0.2 µs a tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.at = dict(self._now())

    def _now(self) -> Iterator[tuple[str, int]]:
        """Every tensor's place, named as ``split`` names them (a LoRA wrapper's base layer under the layer's name)."""
        for name, p in self.model.named_parameters(remove_duplicate=False):
            yield name.replace(LORA_BASE + ".", "."), p.data_ptr()
        for name, b in self.model.named_buffers(remove_duplicate=False):
            yield name.replace(LORA_BASE + ".", "."), b.data_ptr()

    def moved(self, swapped: Mapping[str, int] | None = None) -> list[str]:
        """Names whose storage is not where it should be; ``swapped``: where refitflow's own shadow swap put
        parameters it writes (``Destination.live_pointers``), now their expected place."""
        self.at.update({n: ptr for n, ptr in (swapped or {}).items() if n in self.at})
        now = dict(self._now())
        return sorted(n for n in set(now) | set(self.at) if now.get(n) != self.at.get(n))

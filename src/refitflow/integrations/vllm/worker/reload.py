"""The ``load_weights`` loader inside vLLM's layerwise reload: what vLLM's own engines do for checkpoint-format
weights (``ipc_engine.py``: ``initialize_layerwise_reload`` → ``model.load_weights`` → ``finalize_layerwise_reload``).

Once a layer's processing transformed its weights (the CPU backend's oneDNN handles, FP8 and Marlin repacks),
its parameters have lost their weight loaders or their loading layout, and a bare ``load_weights`` fails
part-way (``'Parameter' object has no attribute 'weight_loader'``) or writes what no kernel reads. Inside
the layerwise reload every layer is put back in its loading layout, loaded, processed again and copied into
its kernel tensors. ``LayerwiseLoad`` is the ``load`` of a ``BucketLoader``: ``begin`` before a version's
first bucket, ``end`` after its last, on failure too. Layers are processed as at load
(``kernels.as_at_load``). With ``restore`` (shadow mode) every processed layer's attributes are kept at
``begin`` and put back when the version fails: the processing's products (a new oneDNN handle, say) leave
with it, and the ``BucketLoader`` restores the tensors' values — the previous version serves on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from refitflow.integrations.vllm.worker.kernels import as_at_load, quantised_layers

__all__ = ["LayerwiseLoad"]


class LayerwiseLoad:
    def __init__(self, model: torch.nn.Module, model_config: Any, *, restore: bool) -> None:
        self.model, self.model_config, self.restore = model, model_config, restore
        self._kept: dict[int, tuple[torch.nn.Module, dict[str, Any]]] = {}
        self._methods: Any = None

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        # copies: the layerwise reload holds a layer's tensors until all of them came, and the BucketLoader
        # hands views of one window that its next bucket overwrites
        return self.model.load_weights((name, t.clone()) for name, t in weights)  # type: ignore[operator]

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        layers = quantised_layers(self.model)
        if self.restore:
            self._kept = {id(m): (m, dict(vars(m))) for _, m, _ in layers}
        self._methods = as_at_load([method for _, _, method in layers])
        self._methods.__enter__()
        initialize_layerwise_reload(self.model)

    def end(self, failed: bool) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            failed = True
            raise
        finally:
            if self._methods is not None:
                self._methods.__exit__(None, None, None)
                self._methods = None
            kept, self._kept = self._kept, {}
            if failed:
                for module, state in kept.values():
                    vars(module).clear()
                    vars(module).update(state)

"""Layouts as data: how each rank's local parameters map onto canonical (HF-unfused) tensors.

Layouts import only ``refitflow.core``; the stages import layouts, never the reverse.
"""

from refitflow.layouts.canonical import LayoutMap, LocalTensor, ModelDims, Segment, canonical_shapes
from refitflow.layouts.rules import Parallel

__all__ = ["LayoutMap", "LocalTensor", "ModelDims", "Parallel", "Segment", "canonical_shapes"]

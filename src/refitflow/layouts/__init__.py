"""Layouts as data: how each rank's local parameters map onto canonical (HF-unfused) tensors.

Layouts import only ``refitflow.core``; the planner imports layouts, never the reverse. ``rules`` turns tables
into a rank's layout map, ``kinds`` says what each rule kind makes of an entry, ``parallel`` is a rank's place.
"""

from refitflow.layouts.canonical import LayoutMap, LocalTensor, ModelDims, Segment, canonical_shapes
from refitflow.layouts.rules import Parallel

__all__ = ["LayoutMap", "LocalTensor", "ModelDims", "Parallel", "Segment", "canonical_shapes"]

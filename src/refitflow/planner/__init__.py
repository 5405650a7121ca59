"""The planner: pure functions from a publication, a receiver layout and limits to a plan — no stage, no
registry, no transport, no I/O. Everything it decides is testable on its own (``build_plan`` on tiny CPU
tensors).

- ``receiver_layout``: what plans need of a destination (``ReceiverLayout``), built once per destination;
- ``limits``: what bounds a plan (``Limits``; users set them through ``rf.ReceiverConfig``);
- ``compile_filter``: the publications a receiver accepts (compile targets and metadata);
- ``sources``: which trainer rank each byte comes from — the shards a receiver's boxes meet, each entry of a TP
  place taken from one rank, replicas chosen by load;
- ``copies``: receiver segments ∩ publisher segments in canonical space = box copies, with every coverage check;
- ``routes``: how each parameter is written when something is published quantised;
- ``regions``, ``pieces``, ``reads``: box copies grouped per shard, cut into pieces (strided reads ≤ a bucket),
  their reads merged where they continue each other;
- ``checks``: what verify and commit need per bucket (digest units as arrays, the digest index, credits);
- ``build``: pieces into buckets — the plan (``records``: ``Plan``, ``Bucket``, ``Piece``, ``Scatter``,
  ``PlannedRead``);
- ``delta``: which pieces a delta refit leaves or copies, given the digests a storage holds;
- ``fanout``: what this rank holds for others as a relay, and where an upstream relay holds each piece.
"""

from refitflow.planner.build import build_plan
from refitflow.planner.limits import Limits
from refitflow.planner.receiver_layout import ReceiverLayout
from refitflow.planner.records import Bucket, Piece, Plan, PlannedRead, Scatter

__all__ = ["Bucket", "Limits", "Piece", "Plan", "PlannedRead", "ReceiverLayout", "Scatter", "build_plan"]

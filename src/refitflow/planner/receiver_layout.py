"""The receiver layout: what plans need of a receiver's destination, fixed for its lifetime.

Every parameter's name, position, shape, dtype and device, the layout map plans map onto (the receiver's own,
else each parameter one whole canonical tensor), which parameters are quantised and how, the elements each
receives, and the part of a plan's cache key the destination fixes. It is read once from the destination
(``Params``: ``refit.destination.Destination`` is one) — a receiver builds it as it starts, in a worker thread,
so its first refit spends no time on the model's own names, shapes and devices (for 10,000 tensors ≈ 50 ms of
Python, the trivial layout alone ≈ 15 ms). Nothing in it refers to a tensor's bytes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Protocol

import torch

from refitflow.core.dtypes import known_name
from refitflow.core.fanout import RelayParam
from refitflow.layouts.canonical import LocalTensor, sliced
from refitflow.layouts.quant import QuantParam
from refitflow.planner.routes import aux_owner, default_route
from refitflow.planner.sources import Wanted, place_of

__all__ = ["Params", "ReceiverLayout"]


class Params(Protocol):
    """What the planner reads of a destination (once, to build its ``ReceiverLayout``)."""

    @property
    def params(self) -> Mapping[str, torch.Tensor]: ...  # name -> the live parameter (shape, dtype, device)
    @property
    def canonical(self) -> Mapping[str, str]: ...  # tied aliases: name -> the name it is written as
    @property
    def layout(self) -> Mapping[str, LocalTensor] | None: ...
    @property
    def layout_key(self) -> Hashable: ...
    @property
    def quantised(self) -> Mapping[str, QuantParam]: ...  # values name -> format and partners (layouts/quant)
    @property
    def scales(self) -> frozenset[str]: ...  # the quantised parameters' scales and global scales
    @property
    def expected(self) -> Mapping[str, int]: ...  # elements each parameter receives (its layout's, else all)


class ReceiverLayout:
    """``params``' names by position and device, the layout plans map onto, the part of a plan's cache key the
    destination fixes, and what a relay layout says of each parameter (``planner.fanout.held_boxes``)."""

    def __init__(self, dest: Params) -> None:
        self.dest = dest  # what it was built from (a receiver keeps one per destination)
        params = dest.params
        self.names = tuple(params)
        self.position = {n: i for i, n in enumerate(self.names)}
        self.device = {n: str(t.device) for n, t in params.items()}
        self.torch_dtype = {n: t.dtype for n, t in params.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in params.values())  # what a plan lands at most
        self.canonical = dict(dest.canonical)
        self.quantised = dict(dest.quantised)
        self.expected = dict(dest.expected)
        self.exact = dest.layout is None  # whole tensors: shapes must match, every published name known
        scales, quantised = dest.scales, dest.quantised  # scales: routed with their values (planner/routes)
        self.layout: Mapping[str, LocalTensor] = dest.layout or {
            n: sliced(n, quantised[n].format.elements(tuple(t.shape)) if n in quantised else tuple(t.shape))
            for n, t in params.items()
            if n not in scales
        }
        # what a plan reads of each canonical tensor (a layout's: the rest is left out of ``published``)
        self.wanted = None if self.exact else Wanted(self.layout)
        self.place = 0.0 if self.exact else place_of(self.layout)  # where among replicas its reads start
        self.route = default_route(self.layout, quantised, dest.expected)  # nothing published quantised
        self.dtypes = {n: known_name(t.dtype) for n, t in params.items()}  # None: refitflow does not move it
        self.relay_params = tuple(RelayParam(n, self.dtypes[n] or "", tuple(t.shape), 0) for n, t in params.items())
        self.key: Hashable = _Key((
            tuple((n, tuple(t.shape), t.dtype, self.device[n]) for n, t in params.items()),
            tuple(sorted(dest.canonical.items())),
            dest.layout_key,
        ))  # fmt: skip

    def device_of(self, name: str) -> str:
        """The device of a parameter, or of an auxiliary assembly of one (its name, a NUL, a part)."""
        found = self.device.get(name)
        return found if found is not None else self.device[aux_owner(name)]


class _Key:
    """A large key hashed once: a plan cache lookup hashes its key every refit (10,000 parameters: ≈ 0.7 ms)."""

    __slots__ = ("_hash", "value")

    def __init__(self, value: Hashable) -> None:
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Key) and self._hash == other._hash and self.value == other.value)

    def __reduce__(self) -> tuple[type[_Key], tuple[Hashable]]:
        return _Key, (self.value,)  # hashed again where it is unpickled (a str's hash is per process)

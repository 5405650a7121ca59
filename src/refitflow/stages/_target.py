"""The destination as plans see it: what no publication changes, built once per landing.

A receiver builds it when it starts (``PlanCache.target``, in a worker thread), so its first refit
spends no time on the model's own names, shapes and devices: for 10,000 tensors that is ≈ 50 ms of
Python (the trivial layout alone ≈ 15 ms) that every first plan used to pay.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from refitflow.core.dtypes import known_name
from refitflow.core.relay import RelayParam
from refitflow.layouts.canonical import LocalTensor, sliced
from refitflow.stages._context import Landing
from refitflow.stages._route import aux_owner, default_route
from refitflow.stages._wanted import Wanted

__all__ = ["Target"]


class Target:
    """``landing``'s parameters by position and device, the layout plans map onto (the landing's, else
    each parameter whole), the part of a plan's cache key that the landing fixes, and what a relay layout
    says of each parameter (``stages._relay.held_boxes``)."""

    def __init__(self, landing: Landing) -> None:
        self.landing = landing
        params = landing.params
        self.names = tuple(params)
        self.position = {n: i for i, n in enumerate(self.names)}
        self.device = {n: str(t.device) for n, t in params.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in params.values())  # what a plan lands at most
        self.exact = landing.layout is None  # whole tensors: shapes must match, every published name known
        scales, quantised = landing.scales, landing.quantised  # scales: routed with their values (stages/_route)
        self.layout: Mapping[str, LocalTensor] = landing.layout or {
            n: sliced(n, quantised[n].format.elements(tuple(t.shape)) if n in quantised else tuple(t.shape))
            for n, t in params.items()
            if n not in scales
        }
        # what a plan reads of each canonical tensor (a layout's: the rest is left out of ``published``)
        self.wanted = None if self.exact else Wanted(self.layout)
        self.route = default_route(self.layout, quantised, landing.expected)  # nothing published quantised
        self.dtypes = {n: known_name(t.dtype) for n, t in params.items()}  # None: refitflow does not move it
        self.relay_params = tuple(RelayParam(n, self.dtypes[n] or "", tuple(t.shape), 0) for n, t in params.items())
        self.key: Hashable = (
            tuple((n, tuple(t.shape), t.dtype, self.device[n]) for n, t in params.items()),
            tuple(sorted(landing.canonical.items())),
            landing.layout_key,
        )

    def device_of(self, name: str) -> str:
        """The device of a parameter, or of an auxiliary assembly of one (its name, a NUL, a part)."""
        found = self.device.get(name)
        return found if found is not None else self.device[aux_owner(name)]

    @staticmethod
    def of(landing: Landing, known: Target | None) -> Target:
        """``known`` when it was built for ``landing``, else a new one."""
        return known if known is not None and known.landing is landing else Target(landing)

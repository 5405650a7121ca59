"""The link model of ``bench/simulate.py``: a fluid, discrete-event network with max-min fair sharing.

Every transfer, digest pass or CPU-bound step is an *activity*: an amount of work (bytes, or seconds
of a serial lane) that consumes one or more *resources* (a GPU NIC's egress or ingress, a host's
NIC/PCIe, the switch, a receiver's verify unit, a host's CPU cores) at a cost per unit of work. Rates
are **max-min fair** (progressive filling): every active activity's rate rises at the same pace until
a resource it uses is full or it reaches its own cap; those are frozen, the rest keep rising. Rates rise in
each activity's *dominant share* (its largest fraction of a resource's capacity), so a byte flow and a
CPU-bound step sharing cores get equal shares of them. Rates are
recomputed whenever an activity starts or ends; between two events every rate is constant, so the next
event is exact (no time steps). Timers (``at``) schedule plain callbacks: latencies, fixed costs.

Vectorised with numpy over (activity, resource, cost) triples: a recomputation with hundreds of flows
costs about a millisecond.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Activity", "Net"]

_EPS = 1e-12


@dataclass(eq=False)
class Activity:
    """``work`` units consuming ``uses`` = ((resource, cost per unit), ...), at most ``cap`` units a second."""

    work: float
    uses: tuple[tuple[int, float], ...]
    done: Callable[[float], None]
    cap: float = math.inf
    tag: str = ""
    rate: float = 0.0
    started: float = 0.0
    res: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # the finite resources it uses
    cost: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass
class Net:
    """Resources (capacities, units a second) and the activities running over them, on one clock."""

    capacity: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    now: float = 0.0
    active: list[Activity] = field(default_factory=list)
    timers: list[tuple[float, int, Callable[[float], None]]] = field(default_factory=list)
    _serial: int = 0
    _dirty: bool = True

    def resource(self, name: str, capacity: float) -> int:
        self.capacity.append(capacity if capacity > 0 else math.inf)
        self.names.append(name)
        return len(self.capacity) - 1

    def start(self, act: Activity) -> None:
        if act.work <= _EPS:
            self.at(self.now, act.done)
            return
        act.started = self.now
        finite = [(r, c) for r, c in act.uses if c > 0 and math.isfinite(self.capacity[r])]
        act.res = np.array([r for r, _ in finite], dtype=np.int64)
        act.cost = np.array([c for _, c in finite], dtype=float)
        self.active.append(act)
        self._dirty = True

    def stop(self, act: Activity) -> None:
        """End ``act`` now, without calling its ``done`` (a poll loop whose wait is over)."""
        if act in self.active:
            self._advance(self.now)
            self.active.remove(act)
            self._dirty = True

    def at(self, when: float, callback: Callable[[float], None]) -> None:
        self._serial += 1
        heapq.heappush(self.timers, (max(when, self.now), self._serial, callback))

    def _share(self) -> None:
        """Max-min fair shares by progressive filling over every active activity, in each one's dominant share:
        an activity's rate rises as its largest fraction of any resource's capacity does, the same for all, so
        a flow and a CPU-bound step on the same cores get equal parts of them (dominant resource fairness; flows
        over links of one size: plain max-min fair bytes)."""
        acts = self.active
        n = len(acts)
        if not n:
            return
        cap_of = np.array(self.capacity, dtype=float)
        ri = np.repeat(np.arange(n), [len(a.res) for a in acts])
        ci = np.concatenate([a.res for a in acts])
        cv = np.concatenate([a.cost for a in acts])
        # per activity: its largest fraction of a resource per unit of rate (0: no finite resource, its cap only)
        dom = np.zeros(n)
        np.maximum.at(dom, ri, cv / cap_of[ci])
        scale = np.where(dom > 0, 1.0 / np.where(dom > 0, dom, 1.0), 1.0)  # rate per unit of share
        cs = cv * scale[ri]  # each resource's use per unit of share
        left = cap_of.copy()
        caps = np.array([a.cap for a in acts], dtype=float)
        rate = np.zeros(n)
        live = np.ones(n, dtype=bool)
        while live.any():
            on = live[ri]
            load = np.bincount(ci[on], weights=cs[on], minlength=len(left))
            with np.errstate(divide="ignore", invalid="ignore"):
                room = np.where(load > 0, left / load, np.inf)
            step = min(float(room.min(initial=np.inf)), float(((caps - rate) / scale)[live].min()))
            if not math.isfinite(step):
                raise ValueError("an activity uses no finite resource and has no cap: it would take no time")
            rate[live] += step * scale[live]
            left -= step * load
            full = (load > 0) & (left <= 1e-9 * np.maximum(1.0, cap_of))
            frozen = np.zeros(n, dtype=bool)
            if full.any():
                frozen[ri[on & full[ci]]] = True
            frozen |= live & (rate >= caps * (1 - 1e-12))
            if not frozen.any():  # numerical corner: freeze the tightest
                frozen[np.flatnonzero(live)[0]] = True
            live &= ~frozen
        for a, r in zip(acts, rate, strict=True):
            a.rate = float(r)
        self._dirty = False

    def run(self, until: float = math.inf) -> float:
        """Advance until nothing is left to do (or ``until``); returns the clock."""
        while self.active or self.timers:
            if self._dirty:
                self._share()
            ends = [self.now + a.work / a.rate if a.rate > 0 else math.inf for a in self.active]
            t_act = min(ends, default=math.inf)
            t_timer = self.timers[0][0] if self.timers else math.inf
            if not math.isfinite(t_act) and not math.isfinite(t_timer):
                raise RuntimeError("activities are stalled at rate 0 with nothing scheduled")
            t = min(t_act, t_timer)
            if t > until:
                break
            self._advance(t)
            done = [a for a, e in zip(self.active, ends, strict=True) if e <= t * (1 + 1e-12) + 1e-15]
            if done:
                self.active = [a for a in self.active if a not in done]
                self._dirty = True
                for a in done:
                    a.work = 0.0
                    a.done(self.now)
            while self.timers and self.timers[0][0] <= self.now:
                _, _, cb = heapq.heappop(self.timers)
                cb(self.now)
        return self.now

    def _advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            for a in self.active:
                a.work -= a.rate * dt
            self.now = t

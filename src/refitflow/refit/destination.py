"""The parameters a receiver writes, and where the next version's bytes go in each apply mode.

``in_place`` writes the live tensors. ``shadow`` writes a second copy of every parameter (on the
parameter's own device) and at commit either swaps storages (``shadow_commit="swap"``, the default:
``param.data``, keeping the old storage as the next shadow; the Parameter objects the server holds
stay the same, the version they serve changes at once) or copies the shadow into the live storage
(``shadow_commit="copy"``: every pointer stays where it was, so a captured CUDA graph sees the new
version; the receiver does the copy on the device while the fence is ``updating``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping

import torch

from refitflow.core.errors import ConfigError, PlanError
from refitflow.layouts.boxes import volume
from refitflow.layouts.canonical import LocalTensor
from refitflow.layouts.quant import QuantParam, detect
from refitflow.planner.routes import aux_owner
from refitflow.refit.device import devices_of
from refitflow.refit.held import Holding, Holdings
from refitflow.transports.base import as_bytes

__all__ = ["ApplyMode", "Destination", "ShadowCommit"]


class ApplyMode(enum.StrEnum):
    IN_PLACE = "in_place"
    SHADOW = "shadow"


class ShadowCommit(enum.StrEnum):
    SWAP = "swap"  # param.data = shadow (one pointer swap; a captured CUDA graph keeps the old storage)
    COPY = "copy"  # live.copy_(shadow) on the device at commit (pointers kept: CUDA-graph safe)


class Destination:
    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        mode: ApplyMode,
        layout: Mapping[str, LocalTensor] | None = None,
        *,
        shadow_commit: ShadowCommit = ShadowCommit.SWAP,
        quant: Mapping[str, str] | None = None,
    ) -> None:
        self.mode = mode
        self.shadow_commit = shadow_commit
        named = model.named_parameters(remove_duplicate=False) if isinstance(model, torch.nn.Module) else model.items()
        self.params: dict[str, torch.Tensor] = {}  # canonical name -> live tensor
        self.canonical: dict[str, str] = {}  # every name (tied aliases too) -> canonical name
        by_id: dict[int, str] = {}
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"destination {name!r} is not a tensor")
            first = by_id.setdefault(id(tensor), name)
            self.canonical[name] = first
            if first == name:
                if not tensor.is_contiguous():
                    raise ConfigError(f"destination parameter {name!r} is not contiguous")
                self.params[name] = tensor
        if not self.params:
            raise ConfigError("the model has no parameters to refit")
        # quantised parameters (layouts/quant.py): values name -> format and partners; their scales (and global
        # scales) are written with the values, from a quantised publication or by quantising at commit
        self.quantised: dict[str, QuantParam] = detect(self.params, quant)
        self.scales = frozenset(n for q in self.quantised.values() for n in q.derived)
        self._assemblies: dict[str, torch.Tensor] = {}
        self._bytes: dict[tuple[str, int], torch.Tensor] = {}  # target_bytes
        self._memory: dict[tuple[str, int], memoryview | None] = {}  # target_memory
        self.layout = dict(layout) if layout is not None else None
        self.layout_key = None if layout is None else tuple(sorted(layout.items()))
        # a quantised parameter's layout is in elements (NVFP4 stores two a byte)
        shapes = {n: q.format.elements(tuple(self.params[n].shape)) for n, q in self.quantised.items()}
        if self.layout is not None:
            names = set(self.params) - self.scales
            wrong = sorted(
                n
                for n in names | set(self.layout)
                if n not in self.layout or n not in names
                or shapes.get(n, tuple(self.params[n].shape)) != self.layout[n].shape
            )  # fmt: skip
            if wrong:
                raise ConfigError(f"the parameters do not match the layout (names or shapes): {wrong[:20]}")
        # the elements a version writes into each parameter: those its layout maps (padding rows are
        # nobody's: never written, never counted missing), every element without a layout
        self.expected: dict[str, int] = {n: t.numel() for n, t in self.params.items()}
        self.expected |= {n: math.prod(shape) for n, shape in shapes.items()}
        for n, lt in (self.layout or {}).items():
            self.expected[n] = sum(volume(seg.lbox) for seg in lt.segments)
        for n, q in self.quantised.items():  # a quantised parameter that is all padding is never quantised
            if not self.expected[n]:
                self.expected |= dict.fromkeys(q.derived, 0)
        # a copy of the serving version, not empty memory: its pages are resident before the first refit
        # writes them (no page faults inside a refit), and it never holds anything but a complete version
        self.shadows: dict[str, torch.Tensor] = (
            {n: t.detach().clone() for n, t in self.params.items()} if mode is ApplyMode.SHADOW else {}
        )
        self.generation = 0  # swaps so far: shadow targets alternate between two storages
        self._live = {n: t.detach() for n, t in self.params.items()} if self.shadows else {}  # swap()
        self._live_at = {n: t.data_ptr() for n, t in self.params.items()}  # check_unmoved()
        # the digests of the version each storage holds (delta refits; refit/held.py)
        self.holdings = Holdings(shadow=mode is ApplyMode.SHADOW, swaps=shadow_commit is ShadowCommit.SWAP)

    def holding(self, which: str) -> Holding | None:
        """``(digest geometry, digests)`` of the version the ``"target"`` or ``"live"`` storage holds, if known."""
        return self.holdings.get(which, self.generation)

    def check_unmoved(self) -> None:
        """``PlanError`` if a parameter's live storage is not where this destination writes: replaced behind
        refitflow's back (``param.data = …``, ``module.to(…)``, a reload that reallocates), every view,
        registration and plan would point at the old storage, which the model no longer reads. ≈ 0.2 µs a
        parameter."""
        at = self._live_at
        moved = [n for n, p in self.params.items() if p.data_ptr() != at[n]]
        if moved:
            raise PlanError(
                f"{len(moved)} parameter(s) no longer sit where this receiver writes, e.g. {moved[:3]}: their "
                "storage was replaced after the receiver was made (param.data = ..., module.to(...), a weight "
                "reload that reallocates), and the model no longer reads the old one. Nothing was written; "
                "`await receiver.rebind()` follows the model as it is now", tensor=moved[0],
            )  # fmt: skip

    def live_pointers(self) -> dict[str, int]:
        """Where each parameter's live storage is now (``swap`` moves it; the model must read the same)."""
        return dict(self._live_at)

    def live(self, name: str) -> torch.Tensor:
        """The live (serving) tensor of a parameter."""
        return self.params[name].detach()

    def target(self, name: str) -> torch.Tensor:
        """The tensor the next version is written into (the live one, or its shadow)."""
        if self.mode is ApplyMode.SHADOW:
            return self.shadows[name]
        return self.params[name].detach()

    def target_bytes(self, name: str) -> torch.Tensor:
        """``target(name)`` as a flat uint8 view, made once per storage (reads and verify land and hash
        there; a first refit of 10,000 tensors otherwise made 20,000 of these views)."""
        key = (name, self.generation % 2)  # shadow targets alternate between two storages
        view = self._bytes.get(key)
        if view is None:
            view = self._bytes[key] = as_bytes(self.target(name))
        return view

    def target_memory(self, name: str) -> memoryview | None:
        """``target_bytes(name)`` as a memoryview when it is in host memory (None on a device), made once
        per storage: verify hashes its units through it."""
        key = (name, self.generation % 2)
        if key not in self._memory:
            view = self.target_bytes(name)
            self._memory[key] = view.numpy().data if view.device.type == "cpu" else None
        return self._memory[key]

    def assembly(self, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        """A buffer a version is assembled in before it is converted into its parameters (made on first use):
        float32 of a quantised parameter's shape, whose padding (elements the layout does not map) is
        quantised from zero, or — ``like`` — a meta tensor's shape and dtype, on its parameter's device."""
        if name not in self._assemblies:
            if like is not None:
                device = self.params[aux_owner(name)].device
                self._assemblies[name] = torch.empty(like.shape, dtype=like.dtype, device=device)
            else:
                t = self.params[name]
                q = self.quantised.get(name)
                shape = q.format.elements(tuple(t.shape)) if q is not None else tuple(t.shape)
                make = torch.empty if self.expected[name] == math.prod(shape) else torch.zeros  # padding: zeros
                self._assemblies[name] = make(shape, dtype=torch.float32, device=t.device)
        return self._assemblies[name]

    def release_assembly(self, name: str) -> torch.Tensor:
        return self._assemblies.pop(name)

    def landing_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor a read may land in (to register with a transport once)."""
        for name, p in self.params.items():
            yield p.detach()
            if name in self.shadows:
                yield self.shadows[name]

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The devices the parameters sit on (each parameter is written on its own device)."""
        return devices_of(self.params.values())

    @property
    def copies_at_commit(self) -> bool:
        """Shadow mode committing by a device copy into the live storage (``shadow_commit="copy"``)."""
        return self.mode is ApplyMode.SHADOW and self.shadow_commit is ShadowCommit.COPY

    def copy_in(self) -> None:
        """Copy every shadow into its live parameter (``shadow_commit="copy"``; device work, caller orders it)."""
        for name, p in self.params.items():
            p.detach().copy_(self.shadows[name])

    def swap(self) -> None:
        """Make the shadow copies live (shadow mode); synchronous, so no coroutine sees a mix."""
        self.generation += 1
        shadows, live, live_at = self.shadows, self._live, self._live_at
        for name, p in self.params.items():  # ~0.5 us a parameter: a no-drain swap between two engine steps
            new = shadows[name]
            shadows[name] = live[name]
            live[name] = p.data = new
            live_at[name] = new.data_ptr()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params.values())

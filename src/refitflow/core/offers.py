"""Relay offers (``core.fanout``) on the wire. Anything malformed becomes a ``ManifestError``.

Whole (``offer_to_dict``): the tensors ``[name, dtype, shape, region]`` and held boxes ``[rank, tensor, sbox,
param, dbox]`` (boxes flat), O(tensors). Compact, by geometry (``compact=True``), for a peer that holds the
offer's layout (``RelayLayouts``): the layout digest and the runs ``[first, count]`` of the tensors' regions —
and the address as its id (``source_id``) when the peer holds that too — O(1) in the model's size. A peer that
does not hold what a compact offer names refuses it with a ``ManifestError`` saying ``UNKNOWN_LAYOUT``, and gets
it whole. ``relay_from_dict`` reads a compact offer as a ``Relay`` without expanding it (the registry's way).
"""

from __future__ import annotations

from typing import Any

from refitflow.core.errors import ManifestError, RefitError
from refitflow.core.fanout import (
    Geometry,
    HeldBox,
    Relay,
    RelayLayouts,
    RelayOffer,
    RelayParam,
    check_offer_shape,
    expand_runs,
    region_runs,
    source_id,
)
from refitflow.core.types import MAX_INT, Identity, SourceAddress
from refitflow.core.wire import (
    PROTOCOL_VERSION,
    UNKNOWN_LAYOUT,
    check_format,
    identity_dict,
    source_dict,
    source_from,
    typed,
)

__all__ = ["KNOWN", "MAX_OFFER_TENSORS", "geometry_from_dict", "geometry_to_dict", "offer_from_dict", "offer_to_dict",
           "relay_from_dict", "relay_to_dict"]  # fmt: skip

MAX_OFFER_TENSORS = 1 << 24  # the tensors of one relay offer, at most
KNOWN = 8  # relay layouts and addresses a joiner lists as known (the upstream's come back by reference then)
_MAX_RUNS = 1 << 16  # region runs of one compact offer (tensors registered in order: one)


def _flat(box: tuple[tuple[int, int], ...]) -> list[int]:
    return [x for ab in box for x in ab]


def _unflat(v: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(v, list) or len(v) % 2:
        raise ManifestError(f"a box is an even-length list of integers, got {v!r:.60}")
    xs = [typed(x, int) for x in v]
    return tuple(zip(xs[::2], xs[1::2], strict=True))


def _head(identity: Identity, version: int, receiver: str, source: Any, status: int) -> dict[str, Any]:
    return {"format": PROTOCOL_VERSION, "identity": identity_dict(identity), "version": version,
            "receiver": receiver, "source": source, "status": status}  # fmt: skip


def offer_to_dict(o: RelayOffer, *, compact: bool = False, source_known: bool = False) -> dict[str, Any]:
    """A relay offer, whole or ``compact`` (its layout and regions), its address as its id when the peer holds it
    (``source_known``)."""
    source = _source(o.source, source_known)
    head = _head(o.identity, o.version, o.receiver, source, o.status)
    if compact:
        return {**head, "layout": o.layout, "regions": [list(r) for r in region_runs([p.region for p in o.params])]}
    return {**head, "params": [[p.name, p.dtype, list(p.shape), p.region] for p in o.params],
            "held": [[h.rank, h.tensor, _flat(h.sbox), h.param, _flat(h.dbox)] for h in o.held]}  # fmt: skip


def relay_to_dict(identity: Identity, version: int, r: Relay, *, source_known: bool = False) -> dict[str, Any]:
    """A ``Relay`` as a compact offer."""
    return {**_head(identity, version, r.receiver, _source(r.source, source_known), r.status), "layout": r.layout,
            "regions": [list(x) for x in r.regions]}  # fmt: skip


def _source(source: SourceAddress, known: bool) -> Any:
    return source_id(source) if known else source_dict(source)


def _address(d: Any, layouts: RelayLayouts | None) -> SourceAddress:
    if isinstance(d, str):
        source = None if layouts is None else layouts.source(d)
        if source is None:
            raise ManifestError(f"relay offer: {UNKNOWN_LAYOUT} (an address {d:.32})")
        return source
    return source_from(d)


def _runs(runs: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(runs, list) or len(runs) > _MAX_RUNS or not all(
            isinstance(r, list) and len(r) == 2 for r in runs):  # fmt: skip
        raise ManifestError(f"relay offer: regions are at most {_MAX_RUNS} runs [first, count]")
    out = tuple((typed(a, int), typed(n, int)) for a, n in runs)
    if any(not (0 <= a <= MAX_INT and 0 < n <= MAX_INT) for a, n in out) or sum(n for _, n in out) > MAX_OFFER_TENSORS:
        raise ManifestError("relay offer: region runs out of range, or more regions than a relay offer may hold")
    return out


def relay_from_dict(d: Any, layouts: RelayLayouts) -> tuple[Identity, int, Relay]:
    """A compact offer as the ``Relay`` it is (nothing expanded): ``UNKNOWN_LAYOUT`` unless ``layouts`` holds its
    layout (and its address, when it is named by id); the regions must be as many as the layout's tensors."""
    try:
        check_format(d)
        layout = typed(d["layout"], str)
        geometry = layouts.geometry(layout)
        if geometry is None:
            raise ManifestError(f"relay offer: {UNKNOWN_LAYOUT} ({layout:.32})")
        regions = _runs(d["regions"])
        if sum(n for _, n in regions) != len(geometry[0]):
            raise ManifestError(f"relay offer: regions for {sum(n for _, n in regions)} tensors, its layout has "
                                f"{len(geometry[0])}")  # fmt: skip
        identity = Identity(**{k: typed(v, str) for k, v in d["identity"].items()})
        version, status = typed(d["version"], int), typed(d["status"], int)
        receiver = typed(d["receiver"], str)
        if not (0 <= version <= MAX_INT and 0 <= status <= MAX_INT and 0 < len(receiver) <= 1024):
            raise ManifestError("relay offer: version, status region or receiver id out of range")
        return identity, version, Relay(receiver, layout, _address(d["source"], layouts), status, regions)
    except RefitError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed relay offer: {type(exc).__name__}: {exc}") from exc


def offer_from_dict(d: Any, layouts: RelayLayouts | None = None) -> RelayOffer:
    """Build and check a relay offer (a compact one from the geometry ``layouts`` holds: a ``ManifestError``
    saying ``UNKNOWN_LAYOUT`` when it holds none); anything malformed raises ``ManifestError``. A whole offer's
    geometry and an address given whole are recorded in ``layouts``."""
    try:
        check_format(d)
        if "layout" in d:
            layout = typed(d["layout"], str)
            known = None if layouts is None else layouts.params(layout, expand_runs(_runs(d["regions"])))
            if known is None:
                raise ManifestError(f"relay offer: {UNKNOWN_LAYOUT} ({layout:.32})")
            params, held = known
        else:
            layout = ""
            params = tuple(
                RelayParam(typed(n, str), typed(t, str), tuple(typed(x, int) for x in s), typed(r, int))
                for n, t, s, r in d["params"]
            )
            held = tuple(
                HeldBox(typed(r, int), typed(n, str), _unflat(sb), typed(p, int), _unflat(db))
                for r, n, sb, p, db in d["held"]
            )
        offer = RelayOffer(
            identity=Identity(**{k: typed(v, str) for k, v in d["identity"].items()}),
            version=typed(d["version"], int),
            receiver=typed(d["receiver"], str),
            source=_address(d["source"], layouts),
            status=typed(d["status"], int),
            params=params,
            held=held,
            layout=layout,
        )
    except RefitError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed relay offer: {type(exc).__name__}: {exc}") from exc
    if not layout:  # a known layout's geometry was checked when it was recorded
        check_offer_shape(offer)
        if layouts is not None:
            layouts.add(offer)
    if layouts is not None and not isinstance(d["source"], str):
        layouts.add_source(offer.source)
    return offer


def geometry_to_dict(tensors: tuple[tuple[str, str, tuple[int, ...]], ...], held: tuple[HeldBox, ...]
                     ) -> dict[str, Any]:  # fmt: skip
    """A relay layout's geometry (its tensors and held boxes) as the wire carries it."""
    return {"format": PROTOCOL_VERSION, "tensors": [[n, t, list(s)] for n, t, s in tensors],
            "held": [[h.rank, h.tensor, _flat(h.sbox), h.param, _flat(h.dbox)] for h in held]}  # fmt: skip


def geometry_from_dict(d: Any) -> tuple[str, Geometry]:
    """A geometry, checked as a whole offer's is, and its layout digest (computed here)."""
    try:
        check_format(d)
        params = tuple(RelayParam(typed(n, str), typed(t, str), tuple(typed(x, int) for x in s), 0)
                       for n, t, s in d["tensors"])  # fmt: skip
        held = tuple(HeldBox(typed(r, int), typed(n, str), _unflat(sb), typed(p, int), _unflat(db))
                     for r, n, sb, p, db in d["held"])  # fmt: skip
    except RefitError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"malformed relay geometry: {type(exc).__name__}: {exc}") from exc
    offer = RelayOffer(identity=Identity(model="-"), version=0, receiver="-", source=SourceAddress(
        transport="-", agent="-"), status=0, params=params, held=held)  # fmt: skip
    check_offer_shape(offer)
    return offer.layout, (tuple((p.name, p.dtype, p.shape) for p in params), held)

"""Quantised refits: FP8 published and re-sharded exactly, the formats landed from bf16 on the receiver, and
every lossy path explicit — checked byte for byte against an independent reference (``_quant_ref``) on tiny
DeepSeek-V3 and Qwen3-MoE models, and by the logits of a dequantised forward.

Transfers are loopback (one process): the formats are bytes like any others to the transports, and NIXL
moves them in ``bench/quant_bench.py`` and the NIXL pipeline tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import anyio
import numpy as np
import pytest
import torch

import refitflow as rf
from refitflow.layouts import Parallel, canonical_shapes, fused, hf, megatron
from refitflow.layouts.canonical import LocalTensor, from_canonical, to_canonical
from refitflow.layouts.quant import FORMATS
from refitflow.layouts.quant_layout import scale_layout
from refitflow.layouts.wire import layout_metadata
from tests.layouts import _quant_ref as ref
from tests.layouts._models import _logits, _model

# DeepSeek-V3 shaped, with every TP-2 slice of a quantised tensor on the 128 × 128 grid
BIG = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=16, q_lora_rank=128,
    kv_lora_rank=112, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=256,
)  # fmt: skip
SUFFIX = "_scale_inv"


def quantised_name(name: str) -> bool:
    return ".layers." in name and (("_proj" in name and name.endswith(".weight")) or ".mlp.experts." in name)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _per_matrix(x: torch.Tensor, fn: Callable) -> list:
    """``fn`` on each 2-D matrix of ``x`` (the experts of a stacked tensor one by one)."""
    return [fn(m.float().numpy()) for m in x.reshape(-1, *x.shape[-2:])]


def reference_fp8(canon: dict[str, torch.Tensor], pow2: bool = False) -> dict[str, torch.Tensor]:
    """The trainer's publication, quantised by the reference: values float8 and fp32 ``_scale_inv``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in canon.items():
        if not quantised_name(name):
            out[name] = t
            continue
        parts = _per_matrix(t, lambda m: ref.fp8_scaled(m, (128, 128), pow2))
        q = np.stack([p[0] for p in parts]).reshape(t.shape)
        s = np.stack([p[1] for p in parts])
        out[name] = torch.from_numpy(q).view(torch.float8_e4m3fn)
        out[name + SUFFIX] = torch.from_numpy(s.reshape(*t.shape[:-2], *s.shape[-2:]))
    return out


def dequantised(pub: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference dequantisation of a publication (bf16 tensors as they are)."""
    return {
        n: rf_dequant(t, pub[n + SUFFIX]) if t.dtype == torch.float8_e4m3fn else t.float()
        for n, t in pub.items()
        if not n.endswith(SUFFIX)
    }


def _cut(name: str, lt: LocalTensor, canon: dict[str, torch.Tensor]) -> torch.Tensor:
    """One local tensor of a layout, in its canonical tensors' dtype."""
    return from_canonical({name: lt}, {s.canonical: canon[s.canonical] for s in lt.segments})[name]


def local_quantised(layout: dict[str, LocalTensor], pub: dict[str, torch.Tensor], shapes: dict) -> dict:
    """A rank's tensors of ``layout`` cut from the canonical publication: quantised ones with their scales."""
    fmt = FORMATS["fp8_block128"]
    raw = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in pub.items()}
    out = {}
    for n, lt in layout.items():
        if all(quantised_name(s.canonical) for s in lt.segments):
            out[n] = _cut(n, lt, raw).view(torch.float8_e4m3fn)
            sl = scale_layout(fmt, lt, shapes)
            assert sl is not None, n
            out[n + SUFFIX] = _cut(n + SUFFIX, sl, pub)
        else:
            out[n] = _cut(n, lt, pub)
    return out


def zeros_like_layout(layout: dict[str, LocalTensor], quantised: bool, dtype=torch.bfloat16) -> dict:
    fmt = FORMATS["fp8_block128"]
    out = {}
    for n, lt in layout.items():
        q = quantised and all(quantised_name(s.canonical) for s in lt.segments)
        out[n] = torch.zeros(lt.shape, dtype=torch.float8_e4m3fn if q else dtype)
        if q:
            out[n + SUFFIX] = torch.zeros(fmt.scale_shape(lt.shape))
    return out


@pytest.fixture(scope="module")
def deepseek():
    trainer = _model("deepseek_v3", **BIG)
    d = hf.dims_from_config(trainer.config)
    shapes = canonical_shapes(d)
    canon = to_canonical([(hf.layout(d), trainer.state_dict())], shapes)
    return trainer, d, shapes, canon, reference_fp8(canon)


async def _publish_and_refit(
    pubs: list[tuple[dict, dict]], ranks: list[tuple[dict, dict | None]], transport: str = "loopback", **options
):
    """Publish ``pubs`` ((tensors, metadata) per trainer rank) as version 1; refit every (tensors, layout)."""
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    results = []
    with anyio.fail_after(120):
        async with contextlib.AsyncExitStack() as stack:
            for r, (tensors, meta) in enumerate(pubs):
                pub = await stack.enter_async_context(
                    rf.Publisher(registry, identity=ident, rank=r, world_size=len(pubs), metadata=meta,
                                 transport=transport)
                )  # fmt: skip
                await pub.publish(1, tensors)
            for tensors, layout in ranks:
                async with rf.Receiver(tensors, registry, identity=ident, layout=layout, transport=transport,
                                       **options) as recv:  # fmt: skip
                    results.append(await recv.refit(1, timeout=60))
    return results


@pytest.mark.asyncio
async def test_fp8_published_megatron_tp2_lands_in_vllm_tp2_over_nixl_byte_for_byte_and_forwards_the_same(
    deepseek,
) -> None:
    trainer, d, shapes, _canon, pub = deepseek
    mega = [megatron.layout(d, Parallel(tp=2, tp_rank=r)) for r in range(2)]
    infer = [fused.layout(d, Parallel(tp=2, tp_rank=r)) for r in range(2)]
    pubs = [(local_quantised(m, pub, shapes), layout_metadata("megatron", d, Parallel(tp=2, tp_rank=r)))
            for r, m in enumerate(mega)]  # fmt: skip
    ranks = [zeros_like_layout(m, quantised=True) for m in infer]
    results = await _publish_and_refit(pubs, list(zip(ranks, infer, strict=True)), transport="nixl")
    assert all(r.version == 1 for r in results)
    for m, got in zip(infer, ranks, strict=True):
        want = local_quantised(m, pub, shapes)
        assert set(got) == set(want)
        for n in want:  # values and scales, byte for byte: copied, never re-quantised
            assert np.array_equal(_u8(got[n]), _u8(want[n])), n
    # the dequantised forward: the receivers' bytes, dequantised, reassembled, equal the reference's logits
    deq = []
    for m, got in zip(infer, ranks, strict=True):
        local = {}
        for n in m:
            if got[n].dtype == torch.float8_e4m3fn:
                local[n] = rf_dequant(got[n], got[n + SUFFIX])
            else:
                local[n] = got[n].float()
        deq.append(local)
    mine = to_canonical(list(zip(infer, deq, strict=True)), shapes)
    fresh, refm = _model("deepseek_v3", seed=1, **BIG).float(), _model("deepseek_v3", seed=2, **BIG).float()
    fresh.load_state_dict(from_canonical(hf.layout(d), mine))
    refm.load_state_dict(from_canonical(hf.layout(d), dequantised(pub)))
    got_logits, want_logits = _logits(fresh), _logits(refm)
    assert torch.equal(got_logits, want_logits)
    assert not torch.equal(got_logits, _logits(trainer.float()))  # quantisation changed the model


def rf_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The reference's dequantisation of FP8 values and their 128 × 128 block scales (matrix by matrix)."""
    out = []
    for m, sc in zip(q.reshape(-1, *q.shape[-2:]), s.reshape(-1, *s.shape[-2:]).numpy(), strict=True):
        spread = np.repeat(np.repeat(sc, 128, 0), 128, 1)[: m.shape[0], : m.shape[1]]
        out.append(ref.e4m3_value(_u8(m)) * spread)
    return torch.from_numpy(np.stack(out).reshape(q.shape))


@pytest.mark.asyncio
async def test_fp8_published_lands_dequantised_exactly_in_bf16_and_fp32_receivers(deepseek) -> None:
    _, d, _shapes, canon, pub = deepseek
    infer = fused.layout(d, Parallel(tp=2, tp_rank=1))
    bf16, fp32 = zeros_like_layout(infer, False), zeros_like_layout(infer, False, torch.float32)
    exact = {n: torch.zeros(t.shape, dtype=torch.float32) for n, t in canon.items()}  # whole tensors, no layout
    await _publish_and_refit([(pub, {})], [(bf16, infer), (fp32, infer), (exact, None)])
    deq = dequantised(pub)
    want = {n: _cut(n, lt, deq) for n, lt in infer.items()}
    for n in infer:
        assert torch.equal(fp32[n], want[n]), n
        assert torch.equal(bf16[n], want[n].to(torch.bfloat16)), n
    for n, t in exact.items():
        assert torch.equal(t, deq[n]), n


@pytest.mark.asyncio
async def test_a_slice_that_cuts_scale_blocks_is_refused_naming_the_tensor_unless_lossy_is_asked(deepseek) -> None:
    _, d, _shapes, _canon, pub = deepseek
    infer = fused.layout(d, Parallel(tp=4, tp_rank=1))  # 64-row slices of 128-row blocks
    before = zeros_like_layout(infer, quantised=True)
    for t in before.values():
        t.view(torch.uint8).fill_(7) if t.dtype == torch.float8_e4m3fn else t.fill_(7)
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    async with rf.Publisher(registry, identity=ident) as p:
        await p.publish(1, pub)
        kept = {n: t.clone() for n, t in before.items()}
        async with rf.Receiver(before, registry, identity=ident, layout=infer) as recv:
            with pytest.raises(rf.PlanError, match=r"cuts its \(128, 128\) blocks.*lossy_casts is off") as err:
                await recv.refit(1, timeout=30)
            assert err.value.tensor is not None and err.value.tensor in infer
            for n, t in before.items():  # nothing was written
                assert np.array_equal(_u8(t), _u8(kept[n])), n
        async with rf.Receiver(before, registry, identity=ident, layout=infer, lossy_casts=True) as recv:
            await recv.refit(1, timeout=30)
    deq = {n: _cut(n, lt, dequantised(pub)) for n, lt in infer.items()}
    for n, t in before.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        got = rf_dequant(t, before[n + SUFFIX])  # re-quantised on the receiver's own grid: within e4m3's error
        scale = before[n + SUFFIX].reshape(-1, *before[n + SUFFIX].shape[-2:])
        spread = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : t.shape[-2], : t.shape[-1]]
        bound = torch.maximum(deq[n].abs() * 2**-4, spread.reshape(t.shape) * 2**-10) * (1 + 1e-6)
        assert ((got - deq[n]).abs() <= bound).all(), n


@pytest.mark.asyncio
async def test_another_format_than_published_is_a_plan_error_naming_both(deepseek) -> None:
    _, _d, _shapes, canon, pub = deepseek
    name = "model.layers.0.mlp.down_proj.weight"
    w = canon[name].float()
    scale = torch.zeros(FORMATS["mxfp8"].scale_shape(tuple(w.shape)), dtype=torch.uint8)
    mx = {name: torch.zeros(w.shape, dtype=torch.float8_e4m3fn), name + "_scale": scale}
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    async with rf.Publisher(registry, identity=ident) as p:
        await p.publish(1, {name: pub[name], name + SUFFIX: pub[name + SUFFIX]})
        async with rf.Receiver(mx, registry, identity=ident) as recv:
            with pytest.raises(rf.PlanError, match=r"published fp8_block128 and .* is mxfp8.*lossy_casts is off"):
                await recv.refit(1, timeout=30)


FORMAT_CASES = ["fp8_block128", "fp8_block128_pow2", "fp8_block128_ue8m0", "fp8_channel", "mxfp8", "nvfp4"]


def _reference_of(fmt: str, m: np.ndarray) -> tuple:
    """(values bytes, stored scale, global) of one matrix, by the reference."""
    if fmt == "fp8_block128":
        return (*ref.fp8_scaled(m, (128, 128)), None)
    if fmt == "fp8_block128_pow2":
        return (*ref.fp8_scaled(m, (128, 128), True), None)
    if fmt == "fp8_block128_ue8m0":
        q, s = ref.fp8_scaled(m, (128, 128), True)
        return q, ref.ue8m0_packed(s, m.shape[0]), None
    if fmt == "fp8_channel":
        return (*ref.fp8_scaled(m, (1, 0)), None)
    if fmt == "mxfp8":
        return (*ref.mxfp8(m), None)
    return ref.nvfp4(m)


def _dest(fmt_name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A receiver's zeroed quantised tensor ``w`` of ``fmt_name`` (values, scales, global)."""
    fmt = FORMATS[fmt_name]
    stored = (*shape[:-1], shape[-1] // fmt.per_value)
    scale = torch.zeros(fmt.stored_scale_shape(stored), dtype=fmt.stored_scale_dtype)
    out = {"w": torch.zeros(stored, dtype=fmt.values), "w" + fmt.scale_suffix: scale}
    if fmt.global_suffix:
        out["w" + fmt.global_suffix] = torch.zeros(fmt.global_shape(stored))
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("fmt", FORMAT_CASES)
async def test_bf16_published_is_quantised_on_the_receiver_as_the_reference_does(fmt: str) -> None:
    trainer = _model("qwen3_moe", intermediate_size=288, moe_intermediate_size=160)
    sd = trainer.state_dict()
    names = [n for n in sd if n.endswith("mlp.experts.gate_up_proj") or n.endswith("self_attn.q_proj.weight")]
    names = names[:2] if names else [n for n in sd if n.endswith("proj.weight")][:2]
    assert names
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    async with rf.Publisher(registry, identity=ident) as p:
        for version, name in enumerate(names, start=1):
            w = sd[name].contiguous()
            await p.publish(version, {"w": w})
            dest = _dest(fmt, tuple(w.shape))
            declared = {"w": fmt} if fmt == "fp8_block128_pow2" else None  # the others are found by their dtypes
            async with rf.Receiver(dest, registry, identity=ident, quant=declared) as recv:
                await recv.refit(version, timeout=30)
            f = FORMATS[fmt]
            parts = _per_matrix(w, lambda m: _reference_of(fmt, m))
            q = np.stack([x[0] for x in parts])
            assert np.array_equal(_u8(dest["w"]).reshape(q.shape), q), name
            s = np.stack([x[1] for x in parts])
            got_s = dest["w" + f.scale_suffix]
            got_s = _u8(got_s) if got_s.dtype == torch.float8_e4m3fn else got_s.numpy()
            assert np.array_equal(got_s.reshape(s.shape), s), name
            if f.global_suffix:
                g = np.array([x[2] for x in parts], dtype=np.float32)
                assert np.array_equal(dest["w" + f.global_suffix].numpy().reshape(g.shape), g)


@pytest.mark.asyncio
async def test_nvfp4_published_is_copied_into_nvfp4_shards_and_dequantised_exactly_into_bf16() -> None:
    torch.manual_seed(3)
    w = torch.randn(256, 96).to(torch.bfloat16)
    q, s, g = ref.nvfp4(w.float().numpy())
    pub = {"w": torch.from_numpy(q), "w_scale": torch.from_numpy(s).view(torch.float8_e4m3fn),
           "w_scale_2": torch.tensor(g)}  # fmt: skip
    half = {"w": LocalTensor((128, 96), (_seg("w", ((128, 256), (0, 96)), (256, 96)),))}
    whole = _dest("nvfp4", (256, 96))
    shard = _dest("nvfp4", (128, 96))
    plain = {"w": torch.zeros(256, 96, dtype=torch.bfloat16)}
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    async with rf.Publisher(registry, identity=ident) as p:
        await p.publish(1, pub, quant={"w": "nvfp4"})
        for dest, layout in ((whole, None), (shard, half), (plain, None)):
            async with rf.Receiver(dest, registry, identity=ident, layout=layout) as recv:
                await recv.refit(1, timeout=30)
    assert np.array_equal(whole["w"].numpy(), q) and np.array_equal(_u8(whole["w_scale"]), s)
    assert whole["w_scale_2"].item() == g
    assert np.array_equal(shard["w"].numpy(), q[128:]) and np.array_equal(_u8(shard["w_scale"]), s[128:])
    assert torch.equal(plain["w"], torch.from_numpy(ref.nvfp4_dequant(q, s, g)).to(torch.bfloat16))


def _seg(name: str, cbox, shape):
    from refitflow.layouts.boxes import full, shape_of
    from refitflow.layouts.canonical import Segment

    return Segment(name, cbox, full(shape_of(cbox)), shape)


@pytest.mark.asyncio
async def test_pow2_fp8_published_lands_in_sglang_packed_ue8m0_scales_without_requantising() -> None:
    torch.manual_seed(4)
    w = torch.randn(300, 520).to(torch.bfloat16)  # blocks cut at both ends: 3 × 5 blocks, rows padded to 300
    q, s = ref.fp8_scaled(w.float().numpy(), (128, 128), pow2=True)
    pub = {"w": torch.from_numpy(q).view(torch.float8_e4m3fn), "w_scale_inv": torch.from_numpy(s)}
    dest = _dest("fp8_block128_ue8m0", (300, 520))
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    async with rf.Publisher(registry, identity=ident) as p:
        await p.publish(1, pub, quant={"w": "fp8_block128_pow2"})
        async with rf.Receiver(dest, registry, identity=ident) as recv:
            await recv.refit(1, timeout=30)
        assert np.array_equal(_u8(dest["w"]), q)
        assert np.array_equal(dest["w_scale_inv"].numpy(), ref.ue8m0_packed(s, 300))
        # scales that are not declared powers of two would need re-quantising: refused
        await p.publish(2, pub)
        async with rf.Receiver(_dest("fp8_block128_ue8m0", (300, 520)), registry, identity=ident) as recv:
            with pytest.raises(rf.PlanError, match="published fp8_block128 and w is fp8_block128_ue8m0"):
                await recv.refit(2, timeout=30)


@pytest.mark.asyncio
async def test_publishing_packed_scales_or_a_declared_format_that_does_not_fit_is_refused() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    async with rf.Publisher(registry, identity=ident) as p:
        packed = _dest("fp8_block128_ue8m0", (256, 256))
        with pytest.raises(rf.ConfigError, match="is how a receiver stores fp8_block128_pow2"):
            await p.publish(1, packed)
        wrong = {"w": torch.zeros(256, 64, dtype=torch.uint8), "w_scale": torch.zeros(256, 4)}
        with pytest.raises(rf.ConfigError, match="nvfp4 tensor 'w' needs a float8_e4m3fn 'w_scale' of shape"):
            await p.publish(1, wrong, quant={"w": "nvfp4"})
        with pytest.raises(rf.ConfigError, match="unknown quantised format 'fp3'"):
            await p.publish(1, {"w": torch.zeros(4, 4)}, quant={"w": "fp3"})
    with pytest.raises(rf.ConfigError, match=r"needs a float32 'w_scale_inv' of shape \(1, 1\)"):
        rf.Receiver({"w": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, registry, identity=ident)


@pytest.mark.asyncio
async def test_a_manifest_with_bad_quant_metadata_is_refused_and_the_next_good_version_commits() -> None:
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    pubs = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        q, s = ref.fp8_scaled(torch.randn(128, 128).to(torch.bfloat16).float().numpy(), (128, 128))
        pubs.append({"w": torch.from_numpy(q).view(torch.float8_e4m3fn), "w_scale_inv": torch.from_numpy(s)})
    dest = {"w": torch.zeros(128, 128, dtype=torch.float8_e4m3fn), "w_scale_inv": torch.zeros(1, 1)}
    async with rf.Publisher(registry, identity=ident) as p:
        with pytest.raises(rf.ConfigError, match="metadata\\['quant'\\] and \\['digests'\\] are refitflow's"):
            await p.publish(1, pubs[0], metadata={"quant": "{}"})
        first = await p.publish(1, pubs[0])
        async with rf.Receiver(dest, registry, identity=ident) as recv:
            await recv.refit(1, timeout=30)
            # another implementation's manifest, its quant entry garbled: refused, version 1 keeps serving
            garbled = {**first.metadata, "quant": '{"w": "fp9"}'}
            bad = dataclasses.replace(first, version=2, metadata=garbled, layout_digest="")
            await registry.publish(bad)
            with pytest.raises(rf.ManifestError, match="bad quant metadata"):
                await recv.refit(2, timeout=30)
            assert recv.fence.state is rf.FenceState.READY and np.array_equal(_u8(dest["w"]), _u8(pubs[0]["w"]))
            await p.publish(3, pubs[1])
            await recv.refit(3, timeout=30)
    assert np.array_equal(_u8(dest["w"]), _u8(pubs[1]["w"]))
    assert torch.equal(dest["w_scale_inv"], pubs[1]["w_scale_inv"])


@pytest.mark.asyncio
async def test_a_delta_refit_of_fp8_pairs_reads_only_what_changed(deepseek) -> None:
    _, d, shapes, _, pub = deepseek
    infer = fused.layout(d, Parallel(tp=2, tp_rank=0))
    dest = zeros_like_layout(infer, quantised=True)
    name = "model.layers.1.mlp.experts.down"
    v2 = dict(pub)
    v2[name] = pub[name].view(torch.uint8).flip(-1).contiguous().view(torch.float8_e4m3fn)  # new values only
    registry, ident = rf.Registry(), rf.Identity(model="tiny")
    async with (
        rf.Publisher(registry, identity=ident) as p,
        rf.Receiver(dest, registry, identity=ident, layout=infer) as recv,
    ):
        await p.publish(1, pub)
        first = await recv.refit(1, timeout=30)
        await p.publish(2, v2)
        second = await recv.refit(2, timeout=30)
    # the unchanged pairs are skipped (column slices are read as whole rows, so they are pulled again)
    assert first.skipped_bytes == 0 and second.skipped_bytes > first.nbytes / 2
    want = local_quantised(infer, v2, shapes)
    for n in want:
        assert np.array_equal(_u8(dest[n]), _u8(want[n])), n

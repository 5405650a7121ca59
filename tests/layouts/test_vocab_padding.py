"""Vocabulary padding: Megatron (128 × TP) and vLLM (64, then split over TP) pad the embedding and LM head.

Padding rows are nobody's: the planner never reads or writes them, coverage does not count them.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.layouts import ModelDims, Parallel, canonical_shapes, fused, hf, megatron
from refitflow.layouts.boxes import volume
from refitflow.layouts.canonical import from_canonical, to_canonical
from refitflow.layouts.wire import layout_metadata, resolve
from tests.layouts._fp8 import dequantize, scale_name, scale_shape
from tests.layouts._models import _logits, _model, _refit, assert_same_logits

D = ModelDims(vocab=200, hidden=64, layers=1, heads=8, kv_heads=2, head_dim=8, ffn=96)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _rows(layout: dict, name: str) -> tuple[tuple[int, ...], list[tuple[tuple[int, int], tuple[int, int]]]]:
    """(local shape, [(canonical rows, local rows)]) of one vocab-parallel tensor."""
    lt = layout[name]
    return lt.shape, [(s.cbox[0], s.lbox[0]) for s in lt.segments]


def test_megatron_pads_the_vocabulary_to_128_times_tp() -> None:
    assert megatron.padded_vocab(200, 2) == 256 and megatron.padded_vocab(200, 1, 64) == 256
    r0 = megatron.layout(D, Parallel(tp=2, tp_rank=0))
    r1 = megatron.layout(D, Parallel(tp=2, tp_rank=1))
    assert _rows(r0, "embedding.word_embeddings.weight") == ((128, 64), [((0, 128), (0, 128))])
    assert _rows(r1, "embedding.word_embeddings.weight") == ((128, 64), [((128, 200), (0, 72))])
    assert _rows(r1, "output_layer.weight") == ((128, 64), [((128, 200), (0, 72))])
    unpadded = megatron.layout(D, Parallel(tp=2, tp_rank=1), vocab_divisible_by=1)  # 200 rows are even over 2
    assert _rows(unpadded, "embedding.word_embeddings.weight") == ((100, 64), [((100, 200), (0, 100))])


def test_vllm_pads_the_vocabulary_to_64_then_splits_it_over_tp() -> None:
    # vLLM: pad_vocab_size(200, 64) = 256; vocab_range_from_global_vocab_size(256, r, 8) = [32r, 32r + 32)
    assert fused.padded_vocab(200) == 256
    got = [_rows(fused.layout(D, Parallel(tp=8, tp_rank=r)), EMBED) for r in range(8)]
    assert got[0] == ((32, 64), [((0, 32), (0, 32))])
    assert got[6] == ((32, 64), [((192, 200), (0, 8))])
    assert got[7] == ((32, 64), [])  # all padding: nothing to read, nothing expected
    assert _rows(fused.layout(D, Parallel(tp=8, tp_rank=6)), HEAD) == got[6]


def test_padding_that_tp_does_not_split_evenly_is_a_config_error() -> None:
    with pytest.raises(rf.ConfigError, match="padded vocabulary"):
        fused.layout(D, Parallel(tp=3, tp_rank=0))  # 256 rows over 3 ranks
    with pytest.raises(rf.ConfigError, match="at least 1"):
        fused.layout(D, Parallel(), vocab_padding=0)


def test_layout_options_travel_in_the_manifest() -> None:
    par = Parallel(tp=2, tp_rank=1)
    meta = layout_metadata("megatron", D, par, vocab_divisible_by=64)
    layout, _ = resolve(meta["layout"])
    assert layout == megatron.layout(D, par, vocab_divisible_by=64)
    assert layout["output_layer.weight"].shape == (128, 64)  # 200 rows padded to 64 × TP 2: 256, 128 per rank
    with pytest.raises(rf.ConfigError, match="does not take these options"):
        layout_metadata("megatron", D, par, vocab_padding=64)


def _mapped(layout: dict) -> int:
    return sum(volume(s.lbox) for lt in layout.values() for s in lt.segments)


def _real(lt) -> int:
    """The real (mapped) rows at the top of a vocab-parallel tensor."""
    return lt.segments[0].lbox[0][1] if lt.segments else 0


@pytest.mark.asyncio
@pytest.mark.parametrize("verify", ["pulled", "strict"])
async def test_padded_rows_are_neither_read_nor_counted_missing(verify: str) -> None:
    trainer = _model("llama", 2, vocab_size=200)  # Megatron TP 2 pads to 256, vLLM TP 4 to 256 (64 rows each)
    with anyio.fail_after(30):
        # descriptor_bytes=0: column slices read as such, never as their whole rows (exact bytes below)
        ranks, maps, results = await _refit(trainer, (2, 1), (4, 1), fill=7.0, verify=verify, descriptor_bytes=0)
    assert [m[EMBED].shape for m in maps] == [(64, 64)] * 4
    assert [_real(m[EMBED]) for m in maps] == [64, 64, 64, 8]
    for tensors, m in zip(ranks, maps, strict=True):
        for name in (EMBED, HEAD):
            assert (tensors[name][_real(m[name]) :] == 7.0).all(), name  # padding rows never written
    if verify == "pulled":  # exactly the mapped elements' bf16 bytes, per rank
        assert [r.nbytes for r in results] == [r.ideal_bytes for r in results] == [2 * _mapped(m) for m in maps]
    d = hf.dims_from_config(trainer.config)
    fresh = _model("llama", 2, seed=1, vocab_size=200).float()
    canon = to_canonical(list(zip(maps, ranks, strict=True)), canonical_shapes(d))
    fresh.load_state_dict(from_canonical(hf.layout(d), canon))
    assert torch.equal(_logits(fresh), _logits(trainer.float()))


@pytest.mark.asyncio
async def test_tied_padded_embeddings_are_written_once() -> None:
    trainer = _model("llama", 2, vocab_size=200, tie_word_embeddings=True)
    d = hf.dims_from_config(trainer.config)
    assert d.tied and HEAD not in canonical_shapes(d)
    with anyio.fail_after(30):
        ranks, maps, results = await _refit(trainer, (2, 1), (4, 1), fill=7.0, verify="pulled", descriptor_bytes=0)
    assert all(HEAD not in m for m in maps)
    want = trainer.model.embed_tokens.weight.float()
    for r, (tensors, m) in enumerate(zip(ranks, maps, strict=True)):
        real = _real(m[EMBED])
        assert (tensors[EMBED][real:] == 7.0).all()
        assert torch.equal(tensors[EMBED][:real], want[64 * r : 64 * r + real])
    assert [r.nbytes for r in results] == [2 * _mapped(m) for m in maps]


@pytest.mark.asyncio
async def test_a_float8_padded_lm_head_is_quantised_once_its_real_rows_arrived() -> None:
    trainer = _model("llama", 2, vocab_size=200)
    d = hf.dims_from_config(trainer.config)
    canon = to_canonical([(hf.layout(d), trainer.state_dict())], canonical_shapes(d))
    layout = fused.layout(d, Parallel(tp=2, tp_rank=1), vocab_padding=256)  # 128 rows: [128, 200) and 56 padding
    tensors = {n: torch.zeros(lt.shape) for n, lt in layout.items()}
    tensors[HEAD] = torch.full(layout[HEAD].shape, 3.0).to(torch.float8_e4m3fn)
    tensors[scale_name(HEAD)] = torch.zeros(scale_shape(layout[HEAD].shape))
    registry, ident = rf.Registry(), rf.Identity(model="tiny", layout="megatron")
    par = Parallel(tp=1)
    with anyio.fail_after(30):
        async with rf.Publisher(registry, identity=ident, metadata=layout_metadata("megatron", d, par)) as pub:
            await pub.publish(1, from_canonical(megatron.layout(d, par), canon))
            async with rf.Receiver(tensors, registry, identity=ident, layout=layout) as recv:
                result = await recv.refit(1)
    assert result.version == 1
    deq = dequantize(tensors[HEAD], tensors[scale_name(HEAD)])
    want = canon[HEAD][128:200].float()
    assert ((deq[:72] - want).abs() <= want.abs() * 2**-4 + 1e-6).all()
    assert (deq[72:] == 0).all()  # padding rows are quantised from zero, never from stale bytes


@pytest.mark.asyncio
async def test_a_rank_whose_vocabulary_rows_are_all_padding_refits() -> None:
    trainer = _model("llama", 2, vocab_size=200)  # vLLM TP 8: 256 rows, 32 per rank; rank 7 holds [224, 256)
    with anyio.fail_after(60):
        ranks, maps, results = await _refit(trainer, (2, 1), (8, 1), fill=7.0)
    assert maps[7][EMBED].segments == () and (ranks[7][EMBED] == 7.0).all()
    assert [r.version for r in results] == [1] * 8
    assert_same_logits(trainer, "llama", maps, ranks, kv_heads=2, vocab_size=200)


def test_a_float8_parameter_that_is_all_padding_expects_nothing_not_even_its_scale() -> None:
    from refitflow.refit.destination import ApplyMode, Destination

    layout = fused.layout(D, Parallel(tp=8, tp_rank=7))  # rows [224, 256): all padding
    tensors = {n: torch.zeros(lt.shape) for n, lt in layout.items()}
    tensors[HEAD] = torch.zeros(layout[HEAD].shape, dtype=torch.float8_e4m3fn)
    tensors[scale_name(HEAD)] = torch.zeros(scale_shape(layout[HEAD].shape))
    dest = Destination(tensors, ApplyMode.IN_PLACE, layout)
    assert dest.expected[HEAD] == dest.expected[scale_name(HEAD)] == 0
    assert dest.expected[EMBED] == 0 and dest.expected["model.norm.weight"] == 64

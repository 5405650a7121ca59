"""A CPU stand-in for one vLLM worker's model: a plain ``torch.nn.Module`` carrying vLLM's fused parameter
names and shapes for its TP rank (``qkv_proj``, ``gate_up_proj``, Mixtral's ``block_sparse_moe.experts.
routed_experts.w13_weight``/``w2_weight``, DeepSeek's latent attention ``fused_qkv_a_proj``/``q_b_proj``/``kv_b_proj``,
vocabulary rows padded to a multiple of 64), and a ``load_weights`` that takes
HF checkpoint names and shards/fuses them as vLLM's loaders do. vLLM's real model classes need its CUDA
kernels to be built, so the test builds this module instead; the shapes below are written out from
vLLM's layer rules, independently of refitflow's tables.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from refitflow.layouts.canonical import ModelDims

SENTINEL = 7.0  # what every parameter holds at first: padding rows keep it, a refit must never touch them


def _nested(root: torch.nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))


class FusedModel(torch.nn.Module):
    def __init__(self, d: ModelDims, tp: int, tp_rank: int, *, dtype: torch.dtype = torch.bfloat16,
                 fill: float = SENTINEL) -> None:  # fmt: skip
        super().__init__()
        self.d, self.tp, self.r = d, tp, tp_rank
        hd, h = d.head_dim, d.hidden
        self.nq, self.nkv = d.heads // tp, max(1, d.kv_heads // tp)
        self.vocab_rows = -(-d.vocab // 64) * 64 // tp
        vocab = (self.vocab_rows, h)
        shapes = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab, "model.norm.weight": (h,)}
        for i in range(d.layers):
            p = f"model.layers.{i}."
            qkv = (self.nq + 2 * self.nkv) * hd
            shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
            if d.kv_lora_rank:  # vLLM's DeepseekV2MLAAttention with a q LoRA rank
                a, q, kv = d.kv_lora_rank + d.rope_dim, d.q_lora_rank, d.kv_lora_rank
                shapes |= {p + "self_attn.fused_qkv_a_proj.weight": (q + a, h),
                           p + "self_attn.q_a_layernorm.weight": (q,),
                           p + "self_attn.q_b_proj.weight": (self.nq * (hd + d.rope_dim), q),
                           p + "self_attn.kv_a_layernorm.weight": (kv,),
                           p + "self_attn.kv_b_proj.weight": (self.nq * (hd + d.v_head_dim), kv),
                           p + "self_attn.o_proj.weight": (h, self.nq * d.v_head_dim)}  # fmt: skip
            else:
                shapes |= {p + "self_attn.qkv_proj.weight": (qkv, h), p + "self_attn.o_proj.weight": (h, self.nq * hd)}
            if d.qkv_bias:
                shapes[p + "self_attn.qkv_proj.bias"] = (qkv,)
            if d.ffn and not d.moe_layer(i):
                f = d.ffn // tp
                shapes |= {p + "mlp.gate_up_proj.weight": (2 * f, h), p + "mlp.down_proj.weight": (h, f)}
            else:
                f = d.expert_ffn // tp
                shapes |= {p + "block_sparse_moe.gate.weight": (d.experts, h),
                           p + "block_sparse_moe.experts.routed_experts.w13_weight": (d.experts, 2 * f, h),
                           p + "block_sparse_moe.experts.routed_experts.w2_weight": (d.experts, h, f)}  # fmt: skip
        for name, shape in shapes.items():
            _nested(self, name, torch.full(shape, fill, dtype=dtype))

    def param(self, name: str) -> torch.Tensor:
        return self.get_parameter(name).data

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors → this rank's fused slices (as vLLM's weight loaders do); the names loaded."""
        loaded = set()
        hd, r = self.d.head_dim, self.r
        for name, w in weights:
            prefix, _, leaf = name.rpartition(".")
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                rows = w[r * self.vocab_rows : (r + 1) * self.vocab_rows]
                self.param(name)[: rows.shape[0]] = rows
                target = name
            elif name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):  # replicated, [q_a; kv_a]
                target = prefix.rsplit(".", 1)[0] + ".fused_qkv_a_proj.weight"
                at = 0 if "q_a_proj" in name else self.d.q_lora_rank
                self.param(target)[at : at + w.shape[0]] = w
            elif name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):  # column-parallel by heads
                n = w.shape[0] // self.tp
                target = name
                self.param(target)[:] = w[r * n : (r + 1) * n]
            elif ".self_attn." in name and prefix.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj"):
                which = prefix.rsplit(".", 1)[1][0]
                target = prefix.rsplit(".", 1)[0] + ".qkv_proj." + leaf
                kv0 = r * self.nkv if self.d.kv_heads >= self.tp else r // (self.tp // self.d.kv_heads)
                first, count, at = {"q": (r * self.nq, self.nq, 0), "k": (kv0, self.nkv, self.nq),
                                    "v": (kv0, self.nkv, self.nq + self.nkv)}[which]  # fmt: skip
                self.param(target)[at * hd : (at + count) * hd] = w[first * hd : (first + count) * hd]
            elif name.endswith(("gate_proj.weight", "up_proj.weight")) and ".experts." not in name:
                f = w.shape[0] // self.tp
                target = prefix.rsplit(".", 1)[0] + ".gate_up_proj.weight"
                half = 0 if "gate_proj" in name else f
                self.param(target)[half : half + f] = w[r * f : (r + 1) * f]
            elif name.endswith(("o_proj.weight", "down_proj.weight")) and ".experts." not in name:
                k = w.shape[1] // self.tp
                target = name
                self.param(target)[:] = w[:, r * k : (r + 1) * k]
            elif ".experts." in name:  # block_sparse_moe.experts.{e}.w1/w2/w3.weight
                head, rest = name.split(".experts.")
                e, kind = int(rest.split(".")[0]), rest.split(".")[1]
                f = self.d.expert_ffn // self.tp
                if kind == "w2":
                    target = head + ".experts.routed_experts.w2_weight"
                    self.param(target)[e] = w[:, r * f : (r + 1) * f]
                else:
                    target = head + ".experts.routed_experts.w13_weight"
                    half = 0 if kind == "w1" else f
                    self.param(target)[e, half : half + f] = w[r * f : (r + 1) * f]
            else:
                target = name
                self.param(target).copy_(w)
            loaded.add(target)
        return loaded

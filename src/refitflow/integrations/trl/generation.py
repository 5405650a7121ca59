"""TRL's vLLM generation in server mode with refitflow as the weight sync (``GRPOConfig(weight_sync_backend=
"refitflow")`` switches it on; ``grpo.py``).

What changes against TRL's own server mode (``trl.generation.vllm_generation.VLLMGeneration``):

- **no NCCL group.** TRL's client joins the server's workers in an NCCL group at start-up; here every trainer rank
  opens a ``rf.Publisher`` instead (the main process serves the registry), through vLLM's trainer-side API with
  ``RefitflowTrainerInitInfo`` (``integrations/vllm/trainer/``), which initialises the server's ``refitflow``
  backend in shadow mode;
- **``sync_weights``**: every rank publishes its own parameters in place — DTensor (FSDP2) shards as they lie,
  replicated tensors spread over the ranks — where TRL gathers every tensor whole on every rank and broadcasts it
  from the main process; the main process drives the server's update without draining (``no_drain``: pulled,
  verified, voted and swapped between two steps) and every rank returns once the version is committed and released.
  Version ``v`` is the ``v``-th sync (TRL syncs before the first generation and after each optimizer step);
- **``generate``**: vLLM's token-in-token-out route (``/inference/v1/generate``, ``--enable-scale-out``), one request
  per prompt with ``n`` completions, each asking for the minimum weight version ``synced - max_lag`` (a server below
  it answers a retryable 409, retried until ``timeout_s``), and each completion's per-token weight versions read
  from vLLM's spans: ``versions[i]`` (the labels) beside TRL's logprobs, which are the behaviour policy's — what its
  importance-sampling correction needs. A token from weights older than the minimum fails the batch.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from accelerate.utils import broadcast_object_list, gather_object
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from refitflow.core.errors import ConfigError, RefitError, RefitTimeoutError
from refitflow.integrations.trl.options import RefitflowTrl
from refitflow.integrations.vllm.driver.versions import token_versions
from refitflow.integrations.vllm.server.min_version import HEADER
from refitflow.integrations.vllm.trainer import RefitflowTrainerEngine, RefitflowTrainerInitInfo
from refitflow.integrations.vllm.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

__all__ = ["RefitflowVLLMGeneration"]

log = logging.getLogger(__name__)

FINAL_ONLY = 2  # vLLM's RequestOutputKind.FINAL_ONLY: every one of the n completions in the one answer


class RefitflowVLLMGeneration(VLLMGeneration):
    """``VLLMGeneration`` (server mode) with refitflow's weight sync; TRL's constructor arguments plus ``refitflow``."""

    def __init__(self, *args: Any, refitflow: RefitflowTrl, **kwargs: Any) -> None:
        self.options = refitflow
        self.engine: RefitflowTrainerEngine | None = None
        self.synced = 0  # the version the last sync committed (0: the checkpoint the server booted from)
        self.versions: list[list[str]] = []  # the last batch's completions: each token's weight version
        self.history: list[tuple[int, list[list[str]]]] = []  # per generate: (minimum asked, the versions)
        self.sync_seconds: list[float] = []  # each sync, publish to release (the main process's view)
        self.on_sync: list[Callable[[int], None]] = []  # called on every rank after each sync, with its version
        super().__init__(*args, **kwargs)

    # -- start-up: TRL's client for generation, no NCCL group --------------------------------------------------
    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise ConfigError(f"weight_sync_backend='refitflow' needs vllm_mode='server', got {self.mode!r}")
        self.base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        if self.accelerator.is_main_process:
            self.vllm_client = VLLMClient(base_url=self.base_url, connection_timeout=self.server_timeout)
        self.accelerator.wait_for_everyone()

    def _open(self) -> RefitflowTrainerEngine:
        """The trainer engine, on every rank at the first sync (after ``accelerator.prepare``: FSDP2 has made its
        DTensor parameters by then, and the source describes those)."""
        opts, acc = self.options, self.accelerator
        info = RefitflowTrainerInitInfo(rank=acc.process_index, world_size=acc.num_processes, model=opts.model,
                                        registry=opts.registry, registry_bind=opts.registry_bind,
                                        advertise_host=opts.advertise_host, mode="shadow", no_drain=True,
                                        worker_init=dict(opts.worker_init), timeout_s=opts.timeout_s)  # fmt: skip
        client = HTTPVLLMWeightSyncClient(self.base_url, timeout=opts.timeout_s)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(self.model))
        assert isinstance(engine, RefitflowTrainerEngine)
        return engine

    # -- the weight sync ---------------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        start = time.perf_counter()
        if self.engine is None:
            if self.synced and self.accelerator.is_main_process:  # a second train(): the server read from the last
                _shutdown_server(self.vllm_client.session, self.base_url)
            self.engine = self._open()
            self.engine.versions = itertools.count(self.synced + 1)  # versions go on across train() calls
        self.engine.send_weights()  # every rank: its share published, the server's update driven by the main process
        self.synced += 1
        self.sync_seconds.append(time.perf_counter() - start)
        if self.accelerator.is_main_process:
            # as TRL does after a sync: no new request reuses a prompt's KV computed by the old weights
            self.vllm_client.reset_prefix_cache()
        for hook in self.on_sync:
            hook(self.synced)

    def close(self) -> None:
        """The publisher closed on every rank (the server keeps serving the last version; a later sync — another
        ``train()`` — shuts its backend down and initialises it again, against a new publisher)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # -- generation under a minimum weight version ---------------------------------------------------------------
    def generate(self, prompts: list[list[int]], images: list[Any] | None, num_generations: int,
                 profiler: Any = None) -> tuple[Any, ...]:  # fmt: skip
        if images is not None and any(i is not None for i in images):
            raise ConfigError("weight_sync_backend='refitflow' generates from token ids only (no images yet)")
        acc = self.accelerator
        everyone = gather_object(prompts)
        minimum = max(0, self.synced - self.options.max_lag)
        payload: Any = None
        if acc.is_main_process:
            payload = self._generate_main(everyone[::num_generations], num_generations, minimum)
        box = [payload]
        broadcast_object_list(box, from_process=0)
        prompt_ids, completion_ids, logprobs, token_ids, versions = box[0]
        prompt_ids = [ids for ids in prompt_ids for _ in range(num_generations)]
        mine = slice(acc.process_index * len(prompts), (acc.process_index + 1) * len(prompts))
        self.versions = versions[mine]
        self.history.append((minimum, self.versions))
        return prompt_ids[mine], completion_ids[mine], logprobs[mine], token_ids[mine]

    def _generate_main(self, prompts: list[list[int]], n: int, minimum: int) -> tuple[list[Any], ...]:
        sampling = {"n": n, "repetition_penalty": self.repetition_penalty, "temperature": self.temperature,
                    "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p or 0.0,
                    "max_tokens": self.max_completion_length, "logprobs": self.logprobs, "output_kind": FINAL_ONLY,
                    **self.generation_kwargs}  # fmt: skip
        with ThreadPoolExecutor(max_workers=min(8, len(prompts))) as pool:
            answers = list(pool.map(lambda p: self._one(p, sampling, minimum), prompts))
        choices = [c for answer in answers for c in answer["choices"]]
        completion_ids = [list(c["token_ids"]) for c in choices]
        versions = [token_versions(c.get("weight_versions") or [], len(ids)) for c, ids in zip(choices, completion_ids,
                                                                                              strict=True)]  # fmt: skip
        for i, labels in enumerate(versions):
            older = [v for v in labels if not v.isdigit() or int(v) < minimum]
            if minimum > 0 and older:
                raise RefitError(f"completion {i} has tokens of weight version {older[0]}, below the minimum "
                                 f"{minimum} its request asked for")  # fmt: skip
        logprobs, token_ids = _logprobs(choices)
        return list(prompts), completion_ids, logprobs, token_ids, versions

    def _one(self, prompt: list[int], sampling: dict[str, Any], minimum: int) -> dict[str, Any]:
        """One prompt's ``n`` completions, asked of the server with ``minimum``; 409s retried until the deadline."""
        body: dict[str, Any] = {"request_id": f"trl-{uuid.uuid4().hex}", "token_ids": prompt,
                                "sampling_params": sampling}
        deadline = time.monotonic() + self.options.timeout_s
        delay = 0.05
        while True:
            answer = self.vllm_client.session.post(
                f"{self.base_url}/inference/v1/generate", json=body, headers={HEADER: str(minimum)},
                timeout=self.options.timeout_s,
            )
            if answer.status_code == 200:
                return dict(answer.json())
            if answer.status_code != 409:
                raise RefitError(f"generation failed: HTTP {answer.status_code}: {answer.text[:2000]}")
            if time.monotonic() + delay > deadline:
                raise RefitTimeoutError(f"no weight version >= {minimum} on {self.base_url} within "
                                        f"{self.options.timeout_s} s: {answer.text[:500]}")  # fmt: skip
            time.sleep(delay)
            delay = min(1.0, delay * 2)


def _shutdown_server(session: Any, base_url: str) -> None:
    try:
        answer = session.post(f"{base_url}/shutdown_weight_transfer_engine", timeout=60)
        if answer.status_code != 200:
            log.warning("refitflow: the server's backend did not shut down: HTTP %s %s", answer.status_code,
                        answer.text[:500])  # fmt: skip
    except Exception as exc:  # the server may be gone already: nothing left to release there
        log.warning("refitflow: the server's backend did not shut down: %s", exc)


def _logprobs(choices: list[dict[str, Any]]) -> tuple[Any, Any]:
    """TRL's shape from vLLM's token-in-token-out logprobs: per completion, per token, the candidates by descending
    probability (the sampled token always among them); ``(None, None)`` when none were asked for."""
    if not choices or choices[0].get("logprobs") is None:
        return None, None
    all_lps, all_ids = [], []
    for choice in choices:
        seq_lps, seq_ids = [], []
        for entry in choice["logprobs"]["content"]:
            cands = {int(entry["token_id"]): float(entry["logprob"])}
            for top in entry.get("top_logprobs") or []:
                cands.setdefault(int(top["token_id"]), float(top["logprob"]))
            ranked = sorted(cands.items(), key=lambda kv: -kv[1])
            seq_ids.append([t for t, _ in ranked])
            seq_lps.append([None if lp != lp else lp for _, lp in ranked])  # NaN → None, as TRL does
        all_lps.append(seq_lps)
        all_ids.append(seq_ids)
    return all_lps, all_ids

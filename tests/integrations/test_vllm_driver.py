"""The fleet driver's deadlines and failures without a server (httpx, from the vLLM step's install)."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from refitflow.integrations.vllm.driver import ServerError, VllmFleet
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

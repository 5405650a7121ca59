"""The RL loop's side of a vLLM fleet: ``fleet.VllmFleet`` drives servers over vLLM's RL routes (httpx, no vLLM
import), ``checksums`` gives ``/weight_checker``-compatible checksums, ``versions`` tells which weight version
produced each output token.
"""

from refitflow.integrations.vllm.driver.fleet import ServerError, VllmFleet

__all__ = ["ServerError", "VllmFleet"]  # also at the package's old module path, integrations.vllm.driver

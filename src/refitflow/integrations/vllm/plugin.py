"""The ``vllm.general_plugins`` entry point: registers the ``refitflow`` backend with vLLM's factory.

vLLM runs every general plugin in every one of its processes, possibly more than once; the factory
refuses a name twice (``ValueError``), so a repeat registration is a no-op. The engine module (and
refitflow's receiver) is imported only when vLLM creates the engine.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "refitflow"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "refitflow.integrations.vllm.engine", "RefitflowEngine")
    except ValueError:  # registered already, by an earlier run of this hook in this process
        pass

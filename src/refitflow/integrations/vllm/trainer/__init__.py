"""The trainer side of vLLM's weight-transfer API: ``backend`` is refitflow as a ``WeightTransferTrainerFactory``
engine, so RL code that sends weights through vLLM's trainer API switches by one name (docs/trainer-api.md).
Importing it imports vLLM.
"""

from refitflow.integrations.vllm.trainer.backend import RefitflowTrainerEngine, RefitflowTrainerInitInfo

__all__ = ["RefitflowTrainerEngine", "RefitflowTrainerInitInfo"]

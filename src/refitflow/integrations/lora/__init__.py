"""LoRA refits: an adapter's versions published by the trainer, landed whole and verified where an engine's own
LoRA loader reads them, served under a never-reused versioned name (``docs/lora.md``)."""

from refitflow.integrations.lora.adapter import LAYOUT, adapter_identity, lora_name
from refitflow.integrations.lora.publisher import AdapterPublisher
from refitflow.integrations.lora.receiver import AdapterReceiver, Landed

__all__ = ["LAYOUT", "AdapterPublisher", "AdapterReceiver", "Landed", "adapter_identity", "lora_name"]

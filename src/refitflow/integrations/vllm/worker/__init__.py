"""Inside each vLLM worker: the ``refitflow`` weight-transfer backend (``backend.RefitflowEngine``), where the worker
sits (``place``), which layers a refit may write directly and how the others are reloaded (``kernels``, ``mla``,
``reload``, ``reprocessing``), and LoRA landings (``lora``).
"""

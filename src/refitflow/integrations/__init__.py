"""Plug-ins for the systems refitflow serves, by role: ``hosting/`` is the engine-neutral layer every plug-in
stands on (a rank's session, writers, the loop thread, the drivers' HTTP, the one environment reader);
``vllm/`` (worker backend, server plug-ins, trainer side, driver), ``sglang/`` and ``verl/`` plug refitflow
into those systems, ``lora/`` is engine-neutral LoRA refits. Each imports its host package lazily and builds
on the public parts of refitflow; nothing in refitflow imports an integration. Old module paths keep
importing, with a warning (``_moved``).
"""

from refitflow.integrations._moved import install as _install_moved

_install_moved()

"""The ``vllm.general_plugins`` entry point: registers the ``refitflow`` backend with vLLM's factory.

vLLM runs every general plugin in every one of its processes, possibly more than once; the factory
refuses a name twice (``ValueError``), so a repeat registration is a no-op. The engine module (and
refitflow's receiver) is imported only when vLLM creates the engine. The hook also

- sends refitflow's log records to vLLM's log handler, so what refitflow decides (which layers take which
  path, why a worker is fenced) appears in the server's log beside vLLM's own lines;
- installs the serving gate (``gate.install``): in vLLM's engine-core process, a fenced worker pauses
  scheduling and refuses ``resume`` until a version commits; in the API server, requests are refused with
  the reason — and, on a server joining a fleet (``join.install``), until its fleet's driver took it in.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND", "register", "share_vllm_log"]

BACKEND = "refitflow"


BACKEND_MODULE = "refitflow.integrations.vllm.worker.backend"  # imported by vLLM's factory when it makes the engine


def register() -> None:
    from refitflow.integrations.vllm.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, BACKEND_MODULE, "RefitflowEngine")
    except ValueError:  # registered already, by an earlier run of this hook in this process
        pass
    share_vllm_log()
    from refitflow.integrations.vllm.server import gate, join

    gate.install()
    join.install()


def share_vllm_log() -> None:
    """refitflow's records through vLLM's handler (INFO and up), once per process."""
    ours, theirs = logging.getLogger("refitflow"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False

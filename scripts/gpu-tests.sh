#!/usr/bin/env bash
# The GPU tests (device KV, cuda_ipc, the gather kernel), built on a machine without a GPU and
# run on one with a GPU.
#
#   scripts/gpu-tests.sh build   # here: release test binaries + kvconnect, into .device/gpu-tests
#   scripts/gpu-tests.sh run [NAME...]  # there, from the repository root: runs them (or the
#                                       # test-NAME binaries given), logs in $OUT
#
# NIXL_LIB_DIR defaults to a trimmed NIXL copy under .device/nixl-min when one was carried
# (the nixl_vram and nixl_vram_probe tests skip without the library). Each binary gets GPU_TEST_TIMEOUT seconds
# (default 240): a hung test fails, it does not eat the machine's time.
#
# Without a GPU every test skips with a message, so `run` also works (and proves nothing) here.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.device/gpu-tests

build() {
  rm -rf "$dir" && mkdir -p "$dir"
  local bin
  bin="$(cargo build --release -p kvconnect-host --features cuda --bin kvconnect --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)"
  cp "$bin" "$dir/kvconnect"
  for spec in "kvconnect-nixl cuda cuda_ipc" "kvconnect-nixl cuda nixl_vram" "kvconnect-bench cuda nixl_vram_probe" \
              "kvconnect-host cuda device_kv" \
              "kvconnect-host cuda device_kv_processes" "kvconnect-cuda cuda gpu" \
              "kvconnect-lmcache cuda lmcache_device" "kvconnect-flexkv cuda flexkv_device" \
              "kvconnect-host cuda device_kv_caches"; do
    set -- $spec
    cargo test --release -p "$1" --features "$2" --test "$3" --no-run --message-format=json \
      | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])' \
      | while read -r name exe; do cp "$exe" "$dir/test-$name"; done
  done
  strip "$dir"/* 2>/dev/null || true
  du -sh "$dir"/*
}

run() {
  local logs="${OUT:-.device/gpu-logs}" rc=0 nixl=.device/nixl-min/x/.nixl_cu12.mesonpy.libs
  mkdir -p "$logs"
  export KVCONNECT_BIN="$PWD/$dir/kvconnect"
  if [ -z "${NIXL_LIB_DIR:-}" ] && [ -d "$nixl" ]; then export NIXL_LIB_DIR="$PWD/$nixl"; fi
  nvidia-smi -L > "$logs/gpu.txt" 2>&1 || true
  local tests=("$dir"/test-*)
  if [ $# -gt 0 ]; then tests=(); for n in "$@"; do tests+=("$dir/test-$n"); done; fi
  for t in "${tests[@]}"; do
    local name
    name="$(basename "$t")"
    if timeout "${GPU_TEST_TIMEOUT:-240}" "$t" --test-threads=1 --nocapture > "$logs/$name.log" 2>&1; then
      echo "PASS $name: $(grep '^test result' "$logs/$name.log"); lines saying skipping: $(grep -c 'skipping' "$logs/$name.log")"
    else
      rc=1
      echo "FAIL $name (see $logs/$name.log)"
      tail -40 "$logs/$name.log"
    fi
  done
  return $rc
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac

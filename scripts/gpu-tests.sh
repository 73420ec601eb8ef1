#!/usr/bin/env bash
# The GPU tests (device KV, cuda_ipc, the gather kernel), built on a machine without a GPU and
# run on one with a GPU.
#
#   scripts/gpu-tests.sh build   # here: release test binaries + kvconnect + the Python
#                                # package's wheel (feature cuda), into .device/gpu-tests
#   scripts/gpu-tests.sh build-wheel    # the wheel alone
#   scripts/gpu-tests.sh run [NAME...]  # there, from the repository root: runs them (or the
#                                       # test-NAME binaries given; `driver` names the Python
#                                       # driver), logs in $OUT
#   scripts/gpu-tests.sh compare ROUNDS WHEEL_A WHEEL_B
#                                       # there: the driver's adapter benchmarks with two
#                                       # wheels (two builds) in turn, which goes first
#                                       # swapping each round; a line per run and case
#                                       # (GPU_DRIVER_ARGS passed on; COMPARE_CASES: which)
#
# The wheel is abi3: it installs (pip --no-deps --target, no network) into the Python there,
# beside its torch, and tests/gpu/driver.py makes vLLM's GPU worker calls through it with
# torch CUDA tensors; GPU_DRIVER_ARGS are passed on (e.g. --bench). maturin is taken from
# PATH, else from .venv-vllm.
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
  build_wheel
  du -sh "$dir"/*
}

build_wheel() {
  local maturin
  maturin="$(command -v maturin || echo .venv-vllm/bin/maturin)"
  mkdir -p "$dir"
  rm -f "$dir"/kvconnect-*.whl
  "$maturin" build --release --strip -m python/Cargo.toml --features cuda --compatibility linux -o "$dir"
}

# The Python driver: the wheel installed under a temporary directory, then every case (and
# GPU_DRIVER_ARGS). Skips, saying why, where there is no wheel or no torch.
driver() {
  local logs="$1" site
  local wheels=("$dir"/kvconnect-*.whl)
  if [ ! -f "${wheels[0]}" ]; then echo "skipping driver: no wheel in $dir (scripts/gpu-tests.sh build-wheel)"; return 0; fi
  if ! python3 -c 'import torch' 2>/dev/null; then echo "skipping driver: python3 has no torch"; return 0; fi
  site="$(mktemp -d)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[0]}"
  # shellcheck disable=SC2086
  if PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout "${GPU_TEST_TIMEOUT:-600}" \
      python3 tests/gpu/driver.py ${GPU_DRIVER_ARGS:-} > "$logs/driver.log" 2>&1; then
    echo "PASS driver: $(grep -c '^PASS' "$logs/driver.log") cases; lines saying skipping: $(grep -c 'skipping' "$logs/driver.log")"
    grep -E '^(PASS|skipping|\{"bench")' "$logs/driver.log" || true
  else
    echo "FAIL driver (see $logs/driver.log)"
    grep -E '^(PASS|FAIL|skipping)' "$logs/driver.log" || true
    tail -40 "$logs/driver.log"
    return 1
  fi
}

# Two builds' wheels in the driver's benchmarks, alternating (each run: its median of 15
# pairs, and the load's time against the contiguous copy's).
compare() {
  if [ $# -ne 3 ] || [ ! -f "$2" ] || [ ! -f "$3" ]; then
    echo "usage: $0 compare ROUNDS WHEEL_A WHEEL_B (two kvconnect wheels built with build-wheel)" >&2; exit 2
  fi
  local rounds="$1" logs="${OUT:-.device/gpu-logs}" sites
  sites="$(mktemp -d)"
  mkdir -p "$logs"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$sites/a" "$2"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$sites/b" "$3"
  one() {
    local w="$1" r="$2" log="$logs/compare-$1-$2.log"
    # shellcheck disable=SC2086 # GPU_DRIVER_ARGS are split on purpose
    PYTHONPATH="$sites/$w" PYTHONUNBUFFERED=1 timeout "${GPU_TEST_TIMEOUT:-600}" python3 tests/gpu/driver.py --bench \
      --only "${COMPARE_CASES:-bench-pd-fa-hnd-bf16,bench-pd-fa-hnd-bf16-block128}" ${GPU_DRIVER_ARGS:-} > "$log" 2>&1 \
      || { echo "FAIL wheel $w, round $r (see $log)"; tail -20 "$log"; return 1; }
    if ! grep -q '^{"bench"' "$log"; then
      echo "wheel $w, round $r: no benchmark ran: $(tail -1 "$log")"; return 1
    fi
    grep '^{"bench"' "$log" | python3 -c 'import json,sys
for l in sys.stdin:
    d = json.loads(l)
    print(sys.argv[1], "round", sys.argv[2], d["bench"], "vs contiguous", d["adapter_vs_contiguous_q1_median_q3"],
          "vs torch gather", d["adapter_vs_torch_gather_q1_median_q3"][1], "load ms", d["adapter_load_ms_median"],
          "contiguous ms", d["contiguous_copy_ms_median"])' "$w" "$r"
  }
  for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) = 1 ]; then one a "$r" && one b "$r"; else one b "$r" && one a "$r"; fi || return 1
  done
}

run() {
  local logs="${OUT:-.device/gpu-logs}" rc=0 nixl=.device/nixl-min/x/.nixl_cu12.mesonpy.libs
  mkdir -p "$logs"
  export KVCONNECT_BIN="$PWD/$dir/kvconnect"
  if [ -z "${NIXL_LIB_DIR:-}" ] && [ -d "$nixl" ]; then export NIXL_LIB_DIR="$PWD/$nixl"; fi
  nvidia-smi -L > "$logs/gpu.txt" 2>&1 || true
  local tests=("$dir"/test-*) with_driver=1
  if [ $# -gt 0 ]; then
    tests=() with_driver=0
    for n in "$@"; do
      if [ "$n" = driver ]; then with_driver=1; else tests+=("$dir/test-$n"); fi
    done
  fi
  for t in "${tests[@]}"; do
    if [ ! -e "$t" ]; then
      if [ $# -gt 0 ]; then rc=1; echo "FAIL $(basename "$t"): not built (scripts/gpu-tests.sh build)"; fi
      continue
    fi
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
  if [ "$with_driver" = 1 ]; then driver "$logs" || rc=1; fi
  return $rc
}

case "${1:-}" in
  build) build ;;
  build-wheel) build_wheel ;;
  run) shift; run "$@" ;;
  compare) shift; compare "$@" ;;
  *) echo "usage: $0 build|build-wheel|run|compare" >&2; exit 2 ;;
esac

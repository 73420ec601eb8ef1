#!/usr/bin/env bash
# Runs kvconnect's tests inside real vLLM servers: two groups of test scripts side by side,
# then the adapter's driver and the TTFT guard alone. Each group's output is kept in its own
# log and printed whole when the group ends, so the lines of the two never interleave.
#   scripts/vllm-tests.sh VENV [all|checks|guard]
# checks: the two groups, then the event codec's and the driver's checks; guard: the TTFT guard
# alone (CI runs it once nothing else runs beside it); all (the default): both.
# VENV: a venv with vLLM and kvconnect's Python package (scripts/install-vllm.sh, then
# `pip install ./python`). Needs the `kvconnect` binary and the example plugin built
# (`cargo build -p kvconnect-host --bin kvconnect` and `cargo build -p kvconnect-plugin-example`).
#
# Why side by side: a test script keeps about 0.9 of one core busy on average (vLLM's start is
# one process importing after another; a request is one step at a time), so on two cores two
# scripts take little more wall time than one. Each server is still pinned to one core, and
# each script picks its own ports (tests/vllm/harness.py's free_port). The TTFT guard runs
# after both, on a quiet machine, as its figures need.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ ! -x "$1/bin/python" ]; then
  echo "usage: scripts/vllm-tests.sh VENV [all|checks|guard] (VENV: a venv with vLLM and kvconnect" \
    "installed; see scripts/install-vllm.sh)" >&2
  exit 2
fi
py="$1/bin/python"
phase="${2:-all}"
case "$phase" in
  all | checks | guard) ;;
  *) echo "error: unknown phase '$phase'; use all, checks or guard" >&2; exit 2 ;;
esac
export KVCONNECT_REQUIRE_VLLM=1
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

checks() {
  # Each group: its scripts one after another, stopping at the first that fails.
  group() {
    local name="$1"
    shift
    local start=$SECONDS
    for t in "$@"; do
      echo "== [$name ${SECONDS}s] $py $t"
      # shellcheck disable=SC2086 # a script's arguments are split on purpose
      if ! "$py" $t; then
        echo "== [$name] FAILED: $t"
        return 1
      fi
    done
    echo "== [$name] passed in $((SECONDS - start)) s"
  }

  # Group a:
  # - test_pd: P/D over nixl shm with decode loading synchronously (`load: sync`) and over tcp
  #   loading asynchronously (test_tp runs shm asynchronously), jointly negotiated composites,
  #   and requests through the `kvconnect proxy` binary in front of the vLLM servers; then
  #   test_load's checks on its shm and tcp pairs: 200 P/D requests, 8 in flight, vLLM's prefix
  #   cache on: every output equal to monolithic, no failed load, every reusable token taken
  #   from the prefix cache or loaded;
  # - test_cache: vLLM's prefix cache in front of lmcache and flexkv; the example plugin's
  #   prefix hit (lmcache's and flexkv's run on test_api's servers);
  # - test_hma: DYN-3545 on a tiny sliding-window model: the HMA mismatch refused at the
  #   handshake (the failed request's report carries the diff) and, from one deployment file,
  #   at startup;
  # - test_events: lmcache's tier events (tokens, parents, CPU-to-disk moves) on vLLM's own
  #   --kv-events-config publisher, read with vLLM's KVEventBatch decoder; then kvconnect's
  #   codec and publisher read by vLLM's decoder and pyzmq;
  # - test_routing: `kvconnect proxy --routing kv` by two prefill servers' own KV events (vLLM's
  #   --kv-events-config), text and chat prompts tokenized by their /tokenize, one server killed;
  # - test_harness: the benchmarks' stopping of the side not timed (no vLLM server).
  # Each script prints a line of its servers' start and stop times ("servers: ...") as it ends.
  group a tests/vllm/test_harness.py tests/vllm/test_pd.py tests/vllm/test_cache.py tests/vllm/test_hma.py \
    tests/vllm/test_events.py tests/vllm/test_routing.py >"$logs/a.log" 2>&1 &
  a=$!
  # Group b:
  # - test_tp: tensor parallelism: lmcache and flexkv in a TP 2 server; P/D TP 2 -> TP 2,
  #   TP 2 -> TP 1 and TP 1 -> TP 2 over nixl tcp and shm, among three kv_both servers per backend;
  # - test_shapes: the tiny Llama with an fp8 KV cache (fp8, fp8_e5m2) and a tiny
  #   DeepSeek-V2-like MLA model, each in P/D over nixl tcp against the prefill server's own
  #   outputs;
  # - test_api: vLLM's connector API: a failed load recomputed from its first failed block,
  #   preemptions after loads, /reset_prefix_cache emptying lmcache's and flexkv's stores, KV
  #   events; then test_cache's prefix hits on the same lmcache and flexkv servers.
  # Its servers take the other core than group a's (KVCONNECT_VLLM_CORE_SHIFT, harness.py): each
  # group's prefill and single servers on a core of their own.
  KVCONNECT_VLLM_CORE_SHIFT=1 group b tests/vllm/test_tp.py tests/vllm/test_shapes.py tests/vllm/test_api.py \
    >"$logs/b.log" 2>&1 &
  b=$!
  wait "$a"
  ra=$?
  cat "$logs/a.log"
  wait "$b"
  rb=$?
  cat "$logs/b.log"
  if [ "$ra" != 0 ] || [ "$rb" != 0 ]; then
    echo "vllm-tests: a group failed (group a: exit $ra, group b: exit $rb); its log is above" >&2
    exit 1
  fi

  set -e
  # kvconnect's KV event codec and publisher against the venv's own vLLM classes.
  # (Selected from the workspace, they reuse the workspace test build's dependencies.)
  KVCONNECT_VLLM_VENV="$1" cargo test --workspace --test codec --test publisher
  # The adapter's core without vLLM: the vLLM-shaped driver of the GPU tests, over host tensors
  # and nixl tcp (on a GPU machine scripts/gpu-tests.sh runs it over CUDA tensors).
  "$py" tests/gpu/driver.py --device cpu
}

guard() {
  set -e
  # The P/D hop inside vLLM, guarded: KvconnectConnector over shm as configured by default (its
  # loads synchronous there), against a monolithic server, interleaved pairs: behind `kvconnect
  # proxy` (its first token prefill's), and through vLLM's two-request protocol. Fails above 3x
  # and 4x monolithic's TTFT at the median (about twice the 1.5x and 2x recorded in
  # BENCHMARKS.md), or when decode loads fewer than every prompt token (behind the proxy) or
  # every prompt token but the last (vLLM's protocol).
  "$py" tests/vllm/bench_ttft.py --peers kvconnect-first,kvconnect-shm --pairs 5 --prompt-len 410 --max-ratio 3,4
}

# Not under `set -e` until the groups are waited for: a failed group's log is printed first.
if [ "$phase" != guard ]; then
  checks "$1"
fi
if [ "$phase" != checks ]; then
  guard
fi

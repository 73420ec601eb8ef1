#!/usr/bin/env bash
# Runs one fuzz target, or all of them, for SECONDS each (FUZZING.md), as many at a time as
# there are cores (FUZZ_JOBS=N to change it).
#   scripts/fuzz.sh TARGET SECONDS     e.g. scripts/fuzz.sh nixl_wire 60
#   scripts/fuzz.sh all SECONDS
#   scripts/fuzz.sh list
#   scripts/fuzz.sh build              builds every target and runs none (.ci/run builds them
#                                      early, beside the tests, then runs them)
# Needs nightly Rust and cargo-fuzz (cargo install cargo-fuzz). The seed corpus in
# fuzz/corpus/TARGET is read, never written: what the fuzzer finds goes to
# fuzz/target/corpus/TARGET, a crash to fuzz/artifacts/TARGET. Exits non-zero on a crash.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: scripts/fuzz.sh TARGET|all SECONDS, or scripts/fuzz.sh list|build" >&2
  exit 2
}
[ $# -ge 1 ] || usage
targets() { sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^kvconnect-fuzz$'; }
if [ "$1" = list ]; then
  targets
  exit 0
fi
# No sanitizer: the decoders are safe Rust, and without one each target runs several times
# faster. Debug assertions on, so an arithmetic overflow is a crash.
flags=(-s none -a)
need_fuzz() {
  if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "error: cargo-fuzz with a nightly toolchain is needed: rustup toolchain install nightly && cargo install cargo-fuzz" >&2
    exit 2
  fi
}
if [ "$1" = build ]; then
  [ $# -eq 1 ] || usage
  need_fuzz
  cargo +nightly fuzz build "${flags[@]}"
  exit 0
fi
[ $# -eq 2 ] || usage
target="$1"
secs="$2"
case "$secs" in '' | *[!0-9]*) echo "error: SECONDS must be a whole number, got '$secs'" >&2; exit 2 ;; esac
if [ "$target" = all ]; then
  run=$(targets)
else
  if ! targets | grep -qx "$target"; then
    echo "error: no fuzz target '$target'; the targets are:" >&2
    targets | sed 's/^/  /' >&2
    exit 2
  fi
  run="$target"
fi
need_fuzz
cargo +nightly fuzz build "${flags[@]}"

# The targets run side by side, one per core (FUZZ_JOBS overrides): each gets one core for
# its SECONDS, as it would alone.
jobs="${FUZZ_JOBS:-$(nproc)}"
case "$jobs" in '' | *[!0-9]* | 0) echo "error: FUZZ_JOBS must be a whole number above 0, got '$jobs'" >&2; exit 2 ;; esac
# Scratch directories in memory where there is /dev/shm (fuzz/common.rs writes a file per input).
scratch_root=/dev/shm
[ -d "$scratch_root" ] || scratch_root="${TMPDIR:-/tmp}"
one() {
  local t="$1" log="fuzz/target/$1.log" scratch
  mkdir -p "fuzz/target/corpus/$t"
  echo "== $t: ${secs}s"
  scratch=$(mktemp -d "$scratch_root/kvconnect-fuzz-$t.XXXXXX")
  # -rss_limit_mb: a decoder that allocates what a length prefix announces runs out of it.
  if KVCONNECT_FUZZ_SCRATCH="$scratch" cargo +nightly fuzz run "${flags[@]}" "$t" "fuzz/target/corpus/$t" \
    "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
    -print_final_stats=1 >"$log" 2>&1; then
    echo ok >"fuzz/target/$t.status"
  else
    echo CRASH >"fuzz/target/$t.status"
  fi
  rm -rf "$scratch"
}
running=0
for t in $run; do
  rm -f "fuzz/target/$t.status"
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  one "$t" &
  running=$((running + 1))
done
wait
summary=()
crashed=0
for t in $run; do
  status=$(cat "fuzz/target/$t.status" 2>/dev/null || echo CRASH)
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "fuzz/target/$t.log" | tail -1)
  summary+=("$t $status ${runs:-?} executions")
  if [ "$status" != ok ]; then
    crashed=1
    echo "== $t: the fuzzer's last lines" >&2
    tail -40 "fuzz/target/$t.log" >&2
  fi
done
echo "== summary (${secs}s each, $jobs at a time)"
printf '%s\n' "${summary[@]}"
exit "$crashed"

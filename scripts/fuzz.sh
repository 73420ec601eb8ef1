#!/usr/bin/env bash
# Runs one fuzz target, or all of them, for SECONDS each (FUZZING.md).
#   scripts/fuzz.sh TARGET SECONDS     e.g. scripts/fuzz.sh nixl_wire 60
#   scripts/fuzz.sh all SECONDS
#   scripts/fuzz.sh list
# Needs nightly Rust and cargo-fuzz (cargo install cargo-fuzz). The seed corpus in
# fuzz/corpus/TARGET is read, never written: what the fuzzer finds goes to
# fuzz/target/corpus/TARGET, a crash to fuzz/artifacts/TARGET. Exits non-zero on a crash.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: scripts/fuzz.sh TARGET|all|list SECONDS" >&2
  exit 2
}
[ $# -ge 1 ] || usage
targets() { sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^kvconnect-fuzz$'; }
if [ "$1" = list ]; then
  targets
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
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "error: cargo-fuzz with a nightly toolchain is needed: rustup toolchain install nightly && cargo install cargo-fuzz" >&2
  exit 2
fi

# No sanitizer: the decoders are safe Rust, and without one each target runs several times
# faster. Debug assertions on, so an arithmetic overflow is a crash.
flags=(-s none -a)
cargo +nightly fuzz build "${flags[@]}"
summary=()
for t in $run; do
  mkdir -p "fuzz/target/corpus/$t"
  log="fuzz/target/$t.log"
  echo "== $t: ${secs}s"
  status=ok
  # -rss_limit_mb: a decoder that allocates what a length prefix announces runs out of it.
  if ! cargo +nightly fuzz run "${flags[@]}" "$t" "fuzz/target/corpus/$t" "fuzz/corpus/$t" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536 -print_final_stats=1 \
    >"$log" 2>&1; then
    status=CRASH
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  summary+=("$t $status ${runs:-?} executions")
  if [ "$status" != ok ]; then
    tail -40 "$log" >&2
  fi
done
echo "== summary (${secs}s each)"
printf '%s\n' "${summary[@]}"
printf '%s\n' "${summary[@]}" | grep -q CRASH && exit 1
exit 0

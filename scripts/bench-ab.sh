#!/usr/bin/env bash
# Compares two kvconnect builds on `bench transfer`, in interleaved pairs, so both see the same
# machine at nearly the same moment (a shared machine's load swings figures by 3x between
# minutes; a pair's ratio does not).
#
#   scripts/bench-ab.sh BEFORE_BIN AFTER_BIN [PAIRS] [TOKENS]
#
# For each backend (shm, tcp) it runs PAIRS (default 7) pairs, alternating which build goes
# first, each `bench transfer --json` (best of 5 transfers after a warm-up), and prints per
# backend the median and quartiles of after/before transfer time, with the machine's cores and
# load average. A ratio of 1.02 means the after build takes 2% longer.
set -euo pipefail
cd "$(dirname "$0")/.."
before="$1"
after="$2"
pairs="${3:-7}"
tokens="${4:-8192}"
model=fixtures/models/Qwen--Qwen3-0.6B/config.json
# Both builds' workers get a secret, as a real deployment's do (a build without data-plane
# authentication ignores it or uses it as its side-channel token).
KVCONNECT_SIDE_CHANNEL_TOKEN="${KVCONNECT_SIDE_CHANNEL_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
export KVCONNECT_SIDE_CHANNEL_TOKEN

one() {
  "$1" bench transfer --backend "$2" --model "$model" --tokens "$tokens" --json 2>/dev/null \
    | jq -r '.seconds'
}

echo "cores $(nproc); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for backend in shm tcp; do
  ratios=()
  for i in $(seq 1 "$pairs"); do
    if (( i % 2 )); then
      b=$(one "$before" "$backend"); a=$(one "$after" "$backend")
    else
      a=$(one "$after" "$backend"); b=$(one "$before" "$backend")
    fi
    r=$(python3 -c "print(f'{$a / $b:.4f}')")
    echo "$backend pair $i: before ${b}s after ${a}s ratio $r"
    ratios+=("$r")
  done
  python3 - "$backend" "${ratios[@]}" <<'EOF'
import statistics, sys
backend, rs = sys.argv[1], sorted(float(x) for x in sys.argv[2:])
q = statistics.quantiles(rs, n=4, method="inclusive") if len(rs) > 1 else [rs[0]] * 3
print(f"{backend}: after/before median {q[1]:.4f}, quartiles {q[0]:.4f} .. {q[2]:.4f}, {len(rs)} pairs")
EOF
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

"""vLLM's own benchmark client (`vllm bench serve`, called as vllm.benchmarks.serve) against a
baseline and, in the same run, against a kvconnect P/D pair (prefill and decode vLLM servers
with KvconnectConnector over nixl) behind `kvconnect proxy`. Rounds alternate which side goes
first; each round's figure is P/D's over the baseline's (TTFT at the median and p99, output
tokens per second), and the result is the median of the rounds' ratios with the quartiles.

    VENV/bin/python tests/vllm/bench_serve.py [--rounds 5] [--prompts 200] [--in-flight 8]
                                              [--input-len 100] [--output-len 12] [--backend tcp]
                                              [--versus monolithic|nixlconnector]
                                              [--nixl-python DIR] [--idle-step-wait-ms MS]
                                              [--first-token prefill|decode]

Baselines:
- `monolithic` (the default): one vLLM server on core 0, while prefill runs on core 0 and
  decode on core 1 (so P/D has two cores and monolithic one: the ratio is what a P/D pair
  delivers against one engine, not against the same hardware);
- `nixlconnector`: vLLM's own NixlConnector pair (`kv_buffer_device: cpu`, the NIXL Python
  package from --nixl-python DIR, as scripts/install-nixl-python.sh installs it), prefill on
  core 0 and decode on core 1 like kvconnect's, the same server flags, behind its own
  `kvconnect proxy`: the same processes, cores and streams.

Every server runs wholly on its core (its API server and engine core too), and is put back on
it once it is up (vLLM's NixlConnector moves its worker's compute thread to the machine's last
core as it starts). While one side is measured the other side's servers are stopped
(`--other-side paused`, the default): idle, vLLM's NixlConnector pair keeps about half of each
core busy, which would count against whichever side runs beside it.

The kvconnect pair's proxy streams prefill's token first (`--first-token prefill`, the
proxy's default) or speaks vLLM's protocol (`decode`); the baseline's proxy always speaks
vLLM's protocol.

Each P/D decode's external tokens must grow every round and no kvconnect load may fail, so a
pair that fell back to recomputing cannot pass for a fast one. Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Failed, Server, free_port, kv_config, metric, run_checks, serving, stopped  # noqa: E402
from test_pd import nixl, start_proxy  # noqa: E402

EXTERNAL = "vllm:external_prefix_cache_hits_total"


def bench(url: str, model: str, a, seed: int) -> dict:
    """One `vllm bench serve` run of `a.prompts` random prompts at `a.in_flight` in flight."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    args = p.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", "tiny", "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--num-prompts", str(a.prompts),
        "--max-concurrency", str(a.in_flight), "--ignore-eos", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
        # Keeps each request's error in the result (nothing is written without --save-result).
        "--save-detailed",
    ])
    r = main(args)
    if r.get("completed") != a.prompts:
        errors = sorted({e for e in r.get("errors") or [] if e})
        raise Failed(f"{url}: vllm bench serve completed {r.get('completed')} of {a.prompts} requests; "
                     f"errors: {errors[:3]}")
    return r


def quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], statistics.median(xs), q[2]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=12)
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--versus", choices=("monolithic", "nixlconnector"), default="monolithic",
                    help="the baseline: one monolithic server, or vLLM's own NixlConnector pair")
    ap.add_argument("--nixl-python", default=os.environ.get("KVCONNECT_NIXL_PYTHON", ""),
                    help="with --versus nixlconnector: a directory holding the NIXL Python package "
                         "(scripts/install-nixl-python.sh prints it)")
    ap.add_argument("--idle-step-wait-ms", type=float, default=None,
                    help="the P/D servers' adapter key idle_step_wait_ms (unset: the adapter's default)")
    ap.add_argument("--first-token", choices=("prefill", "decode"), default="prefill",
                    help="kvconnect proxy's --first-token for the kvconnect pair (the baseline pair's proxy "
                         "always speaks vLLM's protocol, decode's first token)")
    ap.add_argument("--other-side", choices=("paused", "running"), default="paused",
                    help="while one side is measured, the other side's servers are stopped (SIGSTOP, the "
                         "default: as on machines of their own) or left running idle")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    if a.versus == "nixlconnector" and not (a.nixl_python and Path(a.nixl_python, "nixl").is_dir()):
        sys.exit("--versus nixlconnector needs the NIXL Python package: pass --nixl-python DIR, the "
                 "directory scripts/install-nixl-python.sh prints")

    def checks(model: str, tmp: Path):
        port = free_port()
        pace = {} if a.idle_step_wait_ms is None else {"idle_step_wait_ms": a.idle_step_wait_ms}
        # Every server wholly on its core, its API server and engine core too (as
        # bench_ttft's NixlConnector pair is): no pair borrows the other core's idle time.
        pre = Server("prefill", model, tmp, core=0, whole=True,
                     kv_config=kv_config("kv_producer", nixl(a.backend), port=port, **pace))
        dec = Server("decode", model, tmp, core=1, whole=True,
                     kv_config=kv_config("kv_consumer", nixl(a.backend), **pace))
        if a.versus == "monolithic":
            base = [Server("monolithic", model, tmp, core=0, whole=True)]
        else:
            from bench_ttft import peer_servers
            bpre, bdec, _ = peer_servers("nixlconnector", model, tmp, a.nixl_python, args=())
            base = [bpre, bdec]
        proxies = []
        with serving(*base, pre, dec):
            for s in (*base, pre, dec):
                s.wait_healthy()
            try:
                proxy, url = start_proxy(pre, dec, "--first-token", a.first_token)
                proxies.append(proxy)
                base_url = base[0].url
                if len(base) == 2:
                    proxy, base_url = start_proxy(*base, "--first-token", "decode")
                    proxies.append(proxy)
                ratios = {"ttft_p50": [], "ttft_p99": [], "output_throughput": []}
                rounds = []
                for r in range(a.rounds):
                    ext0 = metric(dec.url, EXTERNAL)
                    base_ext0 = metric(base[-1].url, EXTERNAL)
                    order = [("base", base_url), ("pd", url)]
                    if r % 2:
                        order.reverse()
                    got = {}
                    sides = {"base": base, "pd": [pre, dec]}
                    for name, u in order:
                        time.sleep(2)
                        others = [s for k, v in sides.items() if k != name for s in v]
                        with stopped(others, a.other_side == "paused"):
                            got[name] = bench(u, model, a, seed=100 + r)
                    ext = metric(dec.url, EXTERNAL) - ext0
                    base_ext = metric(base[-1].url, EXTERNAL) - base_ext0
                    failed = metric(dec.url, "vllm:kvconnect_loads_failed_total")
                    if ext <= 0 or failed:
                        raise Failed(f"round {r}: decode loaded {ext:.0f} external tokens, {failed:.0f} loads failed")
                    if len(base) == 2 and base_ext <= 0:
                        raise Failed(f"round {r}: {a.versus}'s decode loaded no external tokens")
                    m, p = got["base"], got["pd"]
                    ratios["ttft_p50"].append(p["median_ttft_ms"] / m["median_ttft_ms"])
                    ratios["ttft_p99"].append(p["p99_ttft_ms"] / m["p99_ttft_ms"])
                    ratios["output_throughput"].append(p["output_throughput"] / m["output_throughput"])
                    rounds.append({k: {a.versus: m[k], "pd": p[k]}
                                   for k in ("median_ttft_ms", "p99_ttft_ms", "output_throughput")}
                                  | {"external_tokens": ext}
                                  | ({f"{a.versus}_external_tokens": base_ext} if len(base) == 2 else {}))
                    print(json.dumps({"round": r, **rounds[-1]}), file=sys.stderr)
            finally:
                for proxy in proxies:
                    proxy.terminate()
                    proxy.wait(30)
        print(json.dumps({"backend": a.backend, "versus": a.versus, "prompts": a.prompts, "in_flight": a.in_flight,
                          "input_len": a.input_len, "output_len": a.output_len, "rounds": a.rounds,
                          f"pd_over_{a.versus}": {k: quartiles(v) for k, v in ratios.items()},
                          "per_round": rounds, "other_side": a.other_side,
                          # Threads a server had moved off its core, put back on it once it was up
                          # (Server.keep_on_core): every server runs on its own core only.
                          "threads_put_back": {s.name: s.moved_back for s in (*base, pre, dec)}}))

    run_checks("bench-serve", a.keep, checks)


if __name__ == "__main__":
    main()

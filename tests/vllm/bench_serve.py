"""vLLM's own benchmark client (`vllm bench serve`, called as vllm.benchmarks.serve) against a
monolithic vLLM server and, in the same run, against a kvconnect P/D pair (prefill and decode
vLLM servers with KvconnectConnector over nixl) behind `kvconnect proxy`. Rounds alternate
which side goes first; each round's figure is P/D's over monolithic's (TTFT at the median and
p99, output tokens per second), and the result is the median of the rounds' ratios with the
quartiles.

    VENV/bin/python tests/vllm/bench_serve.py [--rounds 5] [--prompts 200] [--in-flight 8]
                                              [--input-len 100] [--output-len 12] [--backend tcp]

Servers: monolithic on core 0, prefill on core 0, decode on core 1 (so P/D has two cores and
monolithic one: the ratio is what a P/D pair delivers against one engine, not against the
same hardware). Decode's external tokens must grow every round and no load may fail, so a
pair that fell back to recomputing cannot pass for a fast one. Prints one JSON line.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Failed, Server, free_port, kv_config, metric, run_checks, serving  # noqa: E402
from test_pd import kvconnect_bin, nixl  # noqa: E402


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
    ])
    r = main(args)
    if r.get("completed") != a.prompts:
        raise Failed(f"{url}: vllm bench serve completed {r.get('completed')} of {a.prompts} requests")
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
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()

    def checks(model: str, tmp: Path):
        port = free_port()
        mono = Server("monolithic", model, tmp, core=0)
        pre = Server("prefill", model, tmp, core=0, kv_config=kv_config("kv_producer", nixl(a.backend), port=port))
        dec = Server("decode", model, tmp, core=1, kv_config=kv_config("kv_consumer", nixl(a.backend)))
        with serving(mono, pre, dec):
            for s in (mono, pre, dec):
                s.wait_healthy()
            proxy = subprocess.Popen([str(kvconnect_bin()), "proxy", "--prefill", pre.url, "--decode", dec.url,
                                      "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
            try:
                first = proxy.stdout.readline()
                if not first:
                    raise Failed(f"kvconnect proxy did not start: {proxy.stderr.read()[:500]}")
                url = json.loads(first)["proxy"]
                ratios = {"ttft_p50": [], "ttft_p99": [], "output_throughput": []}
                rounds = []
                for r in range(a.rounds):
                    ext0 = metric(dec.url, "vllm:external_prefix_cache_hits_total")
                    order = [("mono", mono.url), ("pd", url)]
                    if r % 2:
                        order.reverse()
                    got = {}
                    for name, u in order:
                        time.sleep(2)
                        got[name] = bench(u, model, a, seed=100 + r)
                    ext = metric(dec.url, "vllm:external_prefix_cache_hits_total") - ext0
                    failed = metric(dec.url, "vllm:kvconnect_loads_failed_total")
                    if ext <= 0 or failed:
                        raise Failed(f"round {r}: decode loaded {ext:.0f} external tokens, {failed:.0f} loads failed")
                    m, p = got["mono"], got["pd"]
                    ratios["ttft_p50"].append(p["median_ttft_ms"] / m["median_ttft_ms"])
                    ratios["ttft_p99"].append(p["p99_ttft_ms"] / m["p99_ttft_ms"])
                    ratios["output_throughput"].append(p["output_throughput"] / m["output_throughput"])
                    rounds.append({k: {"mono": m[k], "pd": p[k]}
                                   for k in ("median_ttft_ms", "p99_ttft_ms", "output_throughput")}
                                  | {"external_tokens": ext})
                    print(json.dumps({"round": r, **rounds[-1]}), file=sys.stderr)
            finally:
                proxy.terminate()
                proxy.wait(30)
        print(json.dumps({"backend": a.backend, "prompts": a.prompts, "in_flight": a.in_flight,
                          "input_len": a.input_len, "output_len": a.output_len, "rounds": a.rounds,
                          "pd_over_monolithic": {k: quartiles(v) for k, v in ratios.items()},
                          "per_round": rounds}))

    run_checks("bench-serve", a.keep, checks)


if __name__ == "__main__":
    main()

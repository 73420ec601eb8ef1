"""Time to first token of P/D through kvconnect (prefill and decode vLLM servers with
KvconnectConnector over nixl tcp) against a monolithic vLLM server, in the same run,
interleaved: each pair sends one fresh prompt to both, in alternating order.

    VENV/bin/python tests/vllm/bench_ttft.py [--pairs 15] [--prompt-len 200]

P/D's TTFT is the prefill request (max_tokens 1) plus decode's first streamed token, as a
proxy speaking vLLM's protocol sees it. Prints the median ratio with quartiles, the medians
in milliseconds, the core count and the load average (BENCHMARKS.md).
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Failed, Server, free_port, kv_config, make_tiny_model, run_checks  # noqa: E402
from test_pd import nixl  # noqa: E402
import requests  # noqa: E402


def first_token_s(url: str, prompt: list[int], request_id: str, params=None) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    t0 = time.perf_counter()
    with requests.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id},
                       stream=True, timeout=120) as r:
        if r.status_code != 200:
            raise Failed(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                return time.perf_counter() - t0
    raise Failed(f"{url}: no token streamed")


def pd_first_token_s(pre: str, dec: str, prompt: list[int], request_id: str) -> float:
    t0 = time.perf_counter()
    r = requests.post(pre + "/v1/completions", headers={"X-Request-Id": request_id}, timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}})
    if r.status_code != 200 or not r.json().get("kv_transfer_params"):
        raise Failed(f"prefill: HTTP {r.status_code}: {r.text[:300]}")
    prefill_s = time.perf_counter() - t0
    return prefill_s + first_token_s(dec, prompt, request_id, r.json()["kv_transfer_params"])


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=200)
    a = ap.parse_args()

    def bench(model: str, tmp: Path):
        args = ["--no-enable-prefix-caching"]
        mono = Server("monolithic", model, tmp, core=0, args=args)
        pre = Server("prefill", model, tmp, core=0, args=args,
                     kv_config=kv_config("kv_producer", nixl("tcp"), port=free_port()))
        dec = Server("decode", model, tmp, core=1, args=args, kv_config=kv_config("kv_consumer", nixl("tcp")))
        try:
            for s in (mono, pre, dec):
                s.wait_healthy()
            rng = random.Random(3)
            fresh = lambda: [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(a.prompt_len)]  # noqa: E731
            # Warm both paths (handshake, first allocations) outside the measurement.
            first_token_s(mono.url, fresh(), "warm-mono")
            pd_first_token_s(pre.url, dec.url, fresh(), "warm-pd")
            ratios, pd_ms, mono_ms = [], [], []
            for i in range(a.pairs):
                p = fresh()
                if i % 2 == 0:
                    m = first_token_s(mono.url, p, f"mono-{i}")
                    d = pd_first_token_s(pre.url, dec.url, p, f"pd-{i}")
                else:
                    d = pd_first_token_s(pre.url, dec.url, p, f"pd-{i}")
                    m = first_token_s(mono.url, p, f"mono-{i}")
                ratios.append(d / m)
                pd_ms.append(d * 1e3)
                mono_ms.append(m * 1e3)
            q1, med, q3 = quartiles(ratios)
            out = {
                "pairs": a.pairs, "prompt_len": a.prompt_len,
                "ttft_ratio_pd_over_mono": {"q1": round(q1, 3), "median": round(med, 3), "q3": round(q3, 3)},
                "pd_ttft_ms_median": round(statistics.median(pd_ms), 1),
                "mono_ttft_ms_median": round(statistics.median(mono_ms), 1),
                "cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
            print(json.dumps(out))
        finally:
            for s in (mono, pre, dec):
                s.stop()

    run_checks("bench", False, bench)


if __name__ == "__main__":
    main()

"""KV routing against round-robin in front of real vLLM servers: `kvconnect proxy --routing kv`
(by the prefill servers' own KV events, prompts tokenized by their `/tokenize`) against
`--routing round-robin`, the same servers, the same prompts, interleaved.

    VENV/bin/python tests/vllm/bench_routing.py [--prefill 2] [--pairs 5] [--documents 8]
        [--repeats 4] [--words 30] [--settle 0.3]

Servers: `--prefill` prefill servers (KvconnectConnector over nixl shm, vLLM's prefix cache,
`--kv-events-config` with a replay endpoint, `--enable-prompt-tokens-details`) and one
decode server, each pinned to a core in turn. Each run starts a proxy with one routing and
both publishers, empties every server's prefix cache (`/reset_prefix_cache`), then sends the
workload one request at a time, each streamed: `--documents` text documents of `--words`
words (several of vLLM's blocks), each asked `--repeats` times with a different question
after it, in a shuffled order, `--settle` seconds apart (a vLLM CPU server keeps its core
busy for a while after a request). Pairs alternate which routing runs first.

Per run: the prefill servers' prefix cache hit rate (vLLM's `prefix_cache_hits` over
`prefix_cache_queries`, in tokens, summed over the prefill servers), the client's time to the
first streamed token (p50), and with `kv` the router's predicted hit tokens against what the
servers reported. Figures: per pair, kv over round-robin, as medians with quartiles. Every
output must equal the other routing's for the same prompt (greedy), and every kv prediction
the servers' report; the script fails otherwise. One JSON object on stdout.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ttft import quartiles, stream  # noqa: E402
from harness import BLOCK, Failed, Server, free_port, kv_config, metric, run_checks, serving  # noqa: E402
from test_pd import kvconnect_bin, nixl  # noqa: E402
from test_routing import document  # noqa: E402


def workload(a, seed: int) -> list[str]:
    """Every document asked `repeats` times, shuffled; documents numbered from `seed` (each
    pair's own)."""
    prompts = [document(seed + d, a.words) + f" question {q}" for d in range(a.documents) for q in range(a.repeats)]
    random.Random(seed).shuffle(prompts)
    return prompts


def hits(pres) -> tuple[float, float]:
    """(prefix cache hits, queries) in tokens, summed over the prefill servers."""
    return (sum(metric(s.url, "vllm:prefix_cache_hits_total") for s in pres),
            sum(metric(s.url, "vllm:prefix_cache_queries_total") for s in pres))


def run(routing: str, pres, dec, flags, prompts, logdir: Path, label: str, settle: float) -> dict:
    """One run of the workload through a fresh proxy routing `routing`, caches emptied first."""
    for s in (*pres, dec):
        r = requests.post(s.url + "/reset_prefix_cache", timeout=30)
        if r.status_code != 200:
            raise Failed(f"{s.name}: /reset_prefix_cache answered HTTP {r.status_code}: {r.text[:200]}")
    cmd = [str(kvconnect_bin()), "proxy", "--listen", "127.0.0.1:0", "--decode", dec.url, "--routing", routing]
    for s in pres:
        cmd += ["--prefill", s.url]
    log = open(logdir / f"proxy-{label}.log", "w")
    proc = subprocess.Popen(cmd + flags, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        first = proc.stdout.readline()
        if not first:
            raise Failed(f"kvconnect proxy did not start: {(logdir / f'proxy-{label}.log').read_text()[:500]}")
        url = json.loads(first)["proxy"]
        # The subscribers connect before the first request (a batch published before would
        # reach the router only through a replay).
        time.sleep(1.0)
        h0, q0 = hits(pres)
        ttft, outputs = [], []
        for i, p in enumerate(prompts):
            time.sleep(settle)
            t, tokens = stream(url, p, f"{label}-{i}")
            ttft.append(t)
            outputs.append(tokens)
        h1, q1 = hits(pres)
        return {"hit_rate": (h1 - h0) / max(q1 - q0, 1), "ttft_p50_ms": statistics.median(ttft) * 1e3,
                "predicted": metric(url, "kvconnect_router_predicted_hit_tokens_total"),
                "reported": metric(url, "kvconnect_router_actual_hit_tokens_total"),
                "outputs": outputs}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--words", type=int, default=30, help="words per document (30: about 200 tokens)")
    ap.add_argument("--settle", type=float, default=0.3)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    if a.prefill < 2 or a.pairs < 1 or a.documents < 1 or a.repeats < 2 or not 10 <= a.words <= 32 or a.settle < 0:
        ap.error("give --prefill >= 2, --pairs >= 1, --documents >= 1, --repeats >= 2, --words from 10 to 32 "
                 "(the servers' context is 256 tokens) and --settle >= 0")

    def bench(model: str, tmp: Path):
        import os
        cores = len(os.sched_getaffinity(0))
        events = [(free_port(), free_port()) for _ in range(a.prefill)]
        dev = {"VLLM_SERVER_DEV_MODE": "1"}
        pres = [Server(f"prefill-{i}", model, tmp, core=i % cores, extra_env=dev,
                       kv_config=kv_config("kv_producer", nixl("shm"), port=free_port()),
                       args=["--enable-prompt-tokens-details", "--kv-events-config", json.dumps({
                           "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                           "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"})])
                for i, (pub, replay) in enumerate(events)]
        dec = Server("decode", model, tmp, core=a.prefill % cores, extra_env=dev,
                     kv_config=kv_config("kv_consumer", nixl("shm")))
        flags = ["--kv-block-size", str(BLOCK)]
        for pub, replay in events:
            flags += ["--kv-events", f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"]
        load0 = os.getloadavg()
        with serving(*pres, dec):
            for s in (*pres, dec):
                s.wait_healthy()
            rows = []
            for pair in range(a.pairs):
                prompts = workload(a, 1000 * (pair + 1))
                order = ("kv", "round-robin") if pair % 2 == 0 else ("round-robin", "kv")
                got = {r: run(r, pres, dec, flags, prompts, tmp, f"{pair}-{r}", a.settle) for r in order}
                kv, rr = got["kv"], got["round-robin"]
                if kv["outputs"] != rr["outputs"]:
                    bad = [i for i, (x, y) in enumerate(zip(kv["outputs"], rr["outputs"])) if x != y]
                    raise Failed(f"pair {pair}: outputs differ between the routings for prompts {bad}")
                if kv["predicted"] != kv["reported"]:
                    raise Failed(f"pair {pair}: the router predicted {kv['predicted']:.0f} hit tokens, the servers "
                                 f"reported {kv['reported']:.0f}")
                rows.append({"pair": pair, "first": order[0],
                             **{f"{k}_{r}": round(got[r][k], 3) for r in ("kv", "round-robin")
                                for k in ("hit_rate", "ttft_p50_ms")},
                             "predicted_tokens": kv["predicted"]})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        hit = [r["hit_rate_kv"] / max(r["hit_rate_round-robin"], 1e-9) for r in rows]
        ttft = [r["ttft_p50_ms_kv"] / r["ttft_p50_ms_round-robin"] for r in rows]
        out = {"prefill": a.prefill, "pairs": a.pairs, "documents": a.documents, "repeats": a.repeats,
               "cores": cores, "loadavg_start": [round(x, 2) for x in load0],
               "loadavg_end": [round(x, 2) for x in os.getloadavg()],
               "hit_rate_kv_over_round_robin": quartiles(hit) if len(hit) > 1 else round(hit[0], 3),
               "ttft_p50_kv_over_round_robin": quartiles(ttft) if len(ttft) > 1 else round(ttft[0], 3),
               "rows": rows}
        print(json.dumps(out))

    run_checks("bench-routing", a.keep, bench)


if __name__ == "__main__":
    main()

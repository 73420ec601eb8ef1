"""Time to first token of P/D through kvconnect (prefill and decode vLLM servers with
KvconnectConnector over nixl) and of P/D through vLLM's own ExampleConnector (shared
storage), each against one monolithic vLLM server in the same run, interleaved: each pair
sends one fresh prompt to both, in alternating order. Then the transfer time of one long
prompt's KV between the two kvconnect servers against a memcpy of its bytes.

    VENV/bin/python tests/vllm/bench_ttft.py [--pairs 15] [--prompt-len 200] [--long-len 480]
                                             [--backend shm|tcp]

At most three servers run at once (about 4 GB each): the monolithic server stays up while
the kvconnect pair, then the ExampleConnector pair, runs beside it. So each P/D figure is a
ratio of interleaved pairs against the same monolithic server; kvconnect against
ExampleConnector is the ratio of those two medians (the two P/D pairs never run together).

P/D's TTFT is the prefill request (max_tokens 1) plus decode's first streamed token, as a
proxy speaking vLLM's protocol sees it. Every P/D output is checked against monolithic's
(greedy), so a path that recomputes or loads wrong KV cannot pass for a fast one. The
transfer time is what decode's nixl worker logs for the pull alone (pin, copy, done); the
baseline is the faster of a single-threaded memcpy and a copy on as many threads as the
pull's copy may use (copy_threads: the cores, at most 8) of the same number of bytes, between
two buffers of this process touched beforehand: each pair times both, and the one with the
lower median over the pairs is the baseline. Prints one JSON line.
"""

import argparse
import ctypes
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Failed, Server, free_port, kv_config, make_tiny_model, run_checks  # noqa: E402
from test_pd import nixl  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402

# The tiny model's context is 512 positions; the long prompt needs room for it.
ARGS = ["--no-enable-prefix-caching", "--max-model-len", "512", "--max-num-batched-tokens", "512"]
DECODE_TOKENS = 4
# Seconds of quiet before each timed request. A vLLM CPU server keeps its cores busy for a
# while after a request; on a small machine that slows whichever server is timed next (a
# monolithic TTFT of 8-11 ms alone measured 30-100 ms at the median between P/D requests).
SETTLE_S = 1.0


def stream(url: str, prompt: list[int], request_id: str, params=None):
    """(seconds to the first streamed token, every token id) of one greedy completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": DECODE_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    t0 = time.perf_counter()
    first, tokens = None, []
    with requests.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id},
                       stream=True, timeout=120) as r:
        if r.status_code != 200:
            raise Failed(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                first = first or time.perf_counter() - t0
                for c in json.loads(line[6:]).get("choices", []):
                    tokens += c.get("token_ids") or []
    if first is None:
        raise Failed(f"{url}: no token streamed")
    return first, tokens


def pd(pre: str, dec: str, prompt: list[int], request_id: str, with_params: bool):
    """vLLM's proxy protocol: prefill (one token, params asking for a remote decode), then
    decode's stream with prefill's params (kvconnect) or the same prompt alone (the
    ExampleConnector finds the prompt's KV in its storage)."""
    t0 = time.perf_counter()
    r = requests.post(pre + "/v1/completions", headers={"X-Request-Id": request_id}, timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}})
    if r.status_code != 200:
        raise Failed(f"prefill: HTTP {r.status_code}: {r.text[:300]}")
    params = r.json().get("kv_transfer_params") if with_params else None
    if with_params and not params:
        raise Failed(f"prefill returned no kv_transfer_params: {r.text[:300]}")
    prefill_s = time.perf_counter() - t0
    first, tokens = stream(dec, prompt, request_id, params)
    return prefill_s + first, tokens


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return {"q1": round(q[0], 3), "median": round(statistics.median(xs), 3), "q3": round(q[2], 3)}


def interleaved(a, mono: Server, pre: Server, dec: Server, label: str, with_params: bool, fresh):
    """Pairs of (monolithic, P/D) on one fresh prompt each, alternating which goes first."""
    m0, tok = stream(mono.url, fresh(), f"warm-mono-{label}")
    pd(pre.url, dec.url, fresh(), f"warm-{label}", with_params)
    ratios, pd_ms, mono_ms = [], [], []
    for i in range(a.pairs):
        p = fresh()
        if i % 2 == 0:
            time.sleep(SETTLE_S)
            m, want = stream(mono.url, p, f"mono-{label}-{i}")
            time.sleep(SETTLE_S)
            d, got = pd(pre.url, dec.url, p, f"{label}-{i}", with_params)
        else:
            time.sleep(SETTLE_S)
            d, got = pd(pre.url, dec.url, p, f"{label}-{i}", with_params)
            time.sleep(SETTLE_S)
            m, want = stream(mono.url, p, f"mono-{label}-{i}")
        if got != want:
            raise Failed(f"{label}: pair {i}: P/D gave {got}, monolithic {want}")
        ratios.append(d / m)
        pd_ms.append(d * 1e3)
        mono_ms.append(m * 1e3)
    return {"ttft_ratio_over_mono": quartiles(ratios), "ttft_ms_median": round(statistics.median(pd_ms), 1),
            "mono_ttft_ms_median": round(statistics.median(mono_ms), 1)}


PULL = re.compile(r"nixl: pull took.*?request=(\S+).*?bytes=(\d+).*?micros=(\d+)")


def pulls(log: str) -> dict:
    """request id -> (bytes, microseconds) from decode's nixl debug lines."""
    out = {}
    for line in log.splitlines():
        clean = re.sub(r"\x1b\[[0-9;]*m", "", line)
        m = PULL.search(clean)
        if m:
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return out


_BUFFERS = {}


MEMCPY_WAYS = ("single-threaded memmove", "torch copy_ on the copy threads")


def memcpy_ways_us(nbytes: int) -> list:
    """Microseconds of each way of the memcpy baseline (MEMCPY_WAYS: one single-threaded
    memcpy, ctypes.memmove, and one copy on torch's threads, copy_) of `nbytes` bytes, between
    two buffers of this process made and touched once, before the first pair, as vLLM's KV
    cache is before the pull writes into it: no page faults and no allocation in the timed
    copy. Each copy's bytes are checked. The way with the lowest median over the pairs is the
    baseline (a pair's faster way would set the minimum of two noisy draws against the pull's
    one)."""
    if nbytes not in _BUFFERS:
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        _BUFFERS[nbytes] = (src, dst)
    src, dst = _BUFFERS[nbytes]
    times = []
    for copy in (lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), lambda: dst.copy_(src)):
        dst.zero_()
        t0 = time.perf_counter_ns()
        copy()
        times.append((time.perf_counter_ns() - t0) / 1e3)
        if not torch.equal(src, dst):
            raise Failed("the memcpy baseline copied wrong bytes")
    return times


def transfer(a, pre: Server, dec: Server, fresh_long):
    """The long prompt's KV pull against a memcpy of as many bytes, interleaved."""
    threads = min(os.cpu_count() or 1, 8)
    torch.set_num_threads(threads)
    pd(pre.url, dec.url, fresh_long(), "warm-long", True)
    pull_us, ways_us, nbytes = [], [], None
    for i in range(a.pairs):
        before = set(pulls(dec.text()))
        time.sleep(SETTLE_S)
        pd(pre.url, dec.url, fresh_long(), f"long-{i}", True)
        deadline = time.time() + 30
        while True:
            new = {k: v for k, v in pulls(dec.text()).items() if k not in before}
            if new or time.time() > deadline:
                break
            time.sleep(0.2)
        if len(new) != 1:
            raise Failed(f"long prompt {i}: decode logged {len(new)} pulls, expected 1\n{dec.tail()}")
        b, us = next(iter(new.values()))
        nbytes = b
        pull_us.append(us)
        ways_us.append(memcpy_ways_us(b))
    way = min(range(len(MEMCPY_WAYS)), key=lambda w: statistics.median(t[w] for t in ways_us))
    copy_us = [t[way] for t in ways_us]
    ratios = [p / c for p, c in zip(pull_us, copy_us)]
    return {"long_prompt_tokens": a.long_len, "kv_bytes": nbytes, "copy_threads": threads,
            "memcpy_way": MEMCPY_WAYS[way],
            "pull_over_memcpy": quartiles(ratios), "pull_us_median": round(statistics.median(pull_us), 1),
            "memcpy_us_median": round(statistics.median(copy_us), 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--long-len", type=int, default=480)
    ap.add_argument("--backend", default="shm", choices=["shm", "tcp"])
    a = ap.parse_args()

    def bench(model: str, tmp: Path):
        rng = random.Random(3)
        fresh = lambda n=a.prompt_len: [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)]  # noqa: E731
        out = {"pairs": a.pairs, "prompt_len": a.prompt_len, "backend": a.backend, "cores": os.cpu_count()}
        mono = Server("monolithic", model, tmp, core=0, args=ARGS)
        try:
            mono.wait_healthy()
            pre = Server("prefill", model, tmp, core=0, args=ARGS,
                         kv_config=kv_config("kv_producer", nixl(a.backend), port=free_port()))
            dec = Server("decode", model, tmp, core=1, args=ARGS, kv_config=kv_config("kv_consumer", nixl(a.backend)),
                         extra_env={"KVCONNECT_LOG": "info,kvconnect_nixl=debug"})
            try:
                pre.wait_healthy()
                dec.wait_healthy()
                out["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
                out["kvconnect"] = interleaved(a, mono, pre, dec, "kvconnect", True, fresh)
                out["transfer"] = transfer(a, pre, dec, lambda: fresh(a.long_len))
            finally:
                pre.stop()
                dec.stop()
            store = tmp / "example-storage"
            example = lambda role: {"kv_connector": "ExampleConnector", "kv_role": role,  # noqa: E731
                                    "kv_connector_extra_config": {"shared_storage_path": str(store)}}
            pre = Server("prefill-example", model, tmp, core=0, args=ARGS, kv_config=example("kv_producer"))
            dec = Server("decode-example", model, tmp, core=1, args=ARGS, kv_config=example("kv_consumer"))
            try:
                pre.wait_healthy()
                dec.wait_healthy()
                out["example_connector"] = interleaved(a, mono, pre, dec, "example", False, fresh)
            finally:
                pre.stop()
                dec.stop()
        finally:
            mono.stop()
        k, e = out["kvconnect"], out["example_connector"]
        out["kvconnect_over_example_median_ratio"] = round(
            k["ttft_ratio_over_mono"]["median"] / e["ttft_ratio_over_mono"]["median"], 3)
        out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(out))

    run_checks("bench", False, bench)


if __name__ == "__main__":
    main()

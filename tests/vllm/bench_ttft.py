"""Time to first token of P/D between two vLLM servers against one monolithic vLLM server in
the same run, interleaved: each pair sends one fresh prompt to both, in alternating order. The
P/D peers, one pair at a time beside the monolithic server (at most three servers, about 4 GB
each):
- kvconnect-shm, kvconnect-tcp: KvconnectConnector over nixl's shm or tcp backend, decode's
  `load` left at its default (`auto`: synchronous over shm for a load of at most 64 MiB, so
  for these prompts; asynchronous over tcp);
- kvconnect-shm-sync, kvconnect-shm-async: over shm, decode loading synchronously (`load:
  "sync"`: the load runs in the step that computes the prompt's last token, not two steps
  before it) or asynchronously (`load: "async"`, vLLM's NixlConnector's way);
- kvconnect-noload: the kvconnect pair with decode sent no params, so it computes the prompt
  itself: the second server's hop alone, no KV moved. Prefill then holds every request's
  blocks until its lease ends and keeps stepping meanwhile on core 0, monolithic's core: with
  `--other-side running` monolithic's times in its pairs are slowed, so read its P/D time, not
  its ratio;
- nixlconnector: vLLM's own NixlConnector on CPU (`kv_buffer_device: cpu`), with the NIXL
  Python package from --nixl-python DIR (`pip install --target DIR nixl==1.5.1`);
- example: vLLM's ExampleConnector (shared storage);
- kvconnect-first: kvconnect-shm's pair behind `kvconnect proxy --first-token prefill`: the
  client streams from the proxy, which sends prefill's token as soon as prefill answers and
  has decode continue after it (decode then loads every prompt token). Its P/D time is the
  client's time to the first streamed token through the proxy, so it includes the proxy's
  hop.

    VENV/bin/python tests/vllm/bench_ttft.py [--pairs 15] [--prompt-len 200] [--peers A,B,...]
        [--nixl-python DIR] [--transfer [--long-len 480]] [--max-ratio R[,R...]] [--breakdown]
        [--other-side paused|running] [--client auto|realtime|normal]

Every server runs wholly on its own core, its API server and engine core included (monolithic
and prefill on core 0, decode on core 1), as on machines of their own. vLLM pins only a
server's compute threads: a prefill server keeps stepping (every 1.5 ms) while it holds a
request's blocks for decode, and its unpinned engine core then took decode's core, making
decode's steps several times slower than on a machine of its own. While one side of a pair is
timed, the other side's servers are stopped (`--other-side paused`, the default: SIGSTOP to
each server's process group, SIGCONT after the request): idle, vLLM's NixlConnector pair keeps
about half of each core busy, and monolithic then measured 117 ms beside it against 65-68 ms
beside kvconnect's pair.

The client is a process on the same cores, and the first token reaches it only once it gets a
core. With monolithic timed, the stopped pair's core is free; with a P/D pair timed, both cores
are busy as the first token travels (prefill stepping until decode has read its blocks, decode
taking the request and loading them), and at the normal priority the client measured about
2 ms of its own wait for a core there. So the client runs each timed request at a real-time
priority (SCHED_FIFO: root or an RLIMIT_RTPRIO above 0), as a client on a machine of its own
would: `--client auto` (the default) does where it may, else says so on stderr; `--client
realtime` insists; `--client normal` leaves it at the normal priority. The JSON's `client` says
which ran. The proxy of kvconnect-first and every server stay at the normal priority: their
waits are counted. The proxy runs on decode's core, which is idle while prefill's token
travels, as on a machine of its own. Left to the kernel, it may run on prefill's core beside
prefill's server: pinned over unpinned, the median of 6 alternated pairs of runs was 0.974.

`--breakdown` splits each P/D request's time into parts: the client's two round trips, and
vLLM's own per-request histograms on each server (arrival to first token; queued to
scheduled, which for decode includes the wait for an asynchronous load; scheduled to first
token).

Each peer's figure is the median (with quartiles) of its pairs' P/D-over-monolithic ratios;
peers are compared by the ratio of those medians (`over_nixlconnector`), as two pairs never
run together, and by their P/D times' medians alone (`ttft_ms_over_nixlconnector`). Decode's loaded tokens per request come from vLLM's
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`. `--max-ratio R[,R...]`:
a regression guard, one ratio per peer in order (the last one for the peers after); the run
fails when a peer's median ratio is above its own, or when a kvconnect peer's decode loaded
fewer than every prompt token but the last (kvconnect-first: fewer than every prompt token).

P/D's TTFT is the prefill request (max_tokens 1) plus decode's first streamed token, as a
proxy speaking vLLM's protocol sees it. Every P/D output is checked against monolithic's
(greedy), so a path that recomputes or loads wrong KV cannot pass for a fast one.
`--transfer`: the first kvconnect peer's pull of one long prompt's KV against a memcpy: the
pull time is what decode's nixl worker logs (pin, copy, done); the baseline is the faster of
a single-threaded memcpy and a copy on as many threads as the pull's copy may use
(copy_threads: the cores, at most 8) of the same number of bytes, between two buffers of this
process touched beforehand: each pair times both, and the one with the lower median over the
pairs is the baseline. Prints one JSON line, with `adapter_build`: how the venv's kvconnect
native module was compiled. kvconnect's figures are the release build's (`pip install
./python`, as users install it); CI's debug build (maturin's `--profile dev`) spends several
times as long in each of the connector's calls, about 2 ms more per request here.
"""

import argparse
import contextlib
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
from harness import (  # noqa: E402
    Failed, Server, free_port, kv_config, make_tiny_model, metric, run_checks, stopped,
)
from test_pd import nixl, start_proxy  # noqa: E402
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


def pd(pre: str, dec: str, prompt: list[int], request_id: str, with_params: bool, parts=None):
    """vLLM's proxy protocol: prefill (one token, params asking for a remote decode), then
    decode's stream with prefill's params (kvconnect) or the same prompt alone (the
    ExampleConnector finds the prompt's KV in its storage). `parts`, a dict, gets the client's
    two round trips."""
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
    if parts is not None:
        parts["client_prefill_ms"] = prefill_s * 1e3
        parts["client_decode_first_ms"] = first * 1e3
    return prefill_s + first, tokens


# vLLM's per-request histograms (their sums, in seconds) that split a request's time on a
# server: arrival at the API server to the first token (ttft), queued in the engine to
# scheduled (queue: for decode, also the wait for an asynchronous load), scheduled to the
# first token (prefill: the forward pass), and arrival to the end (e2e).
PARTS = {"ttft": "vllm:time_to_first_token_seconds_sum", "queue": "vllm:request_queue_time_seconds_sum",
         "prefill": "vllm:request_prefill_time_seconds_sum", "e2e": "vllm:e2e_request_latency_seconds_sum"}


def server_parts(url: str) -> dict:
    text = requests.get(url + "/metrics", timeout=30).text
    out = {}
    for part, name in PARTS.items():
        out[part] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(name + "{") or line.startswith(name + " "))
    return out


def breakdown_of(before: dict, after: dict, role: str) -> dict:
    return {f"{role}_{k}_ms": (after[k] - before[k]) * 1e3 for k in PARTS}


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return {"q1": round(q[0], 3), "median": round(statistics.median(xs), 3), "q3": round(q[2], 3)}


def interleaved(a, mono: Server, pre: Server, dec: Server, label: str, with_params: bool, fresh, proxy=None):
    """Pairs of (monolithic, P/D) on one fresh prompt each, alternating which goes first. With
    `a.breakdown`, each P/D request's time is also split into its parts (client round trips,
    and vLLM's own per-request histograms on both servers and on monolithic), as medians.
    `proxy`: the URL of a `kvconnect proxy` in front of the pair, which P/D requests stream
    from (the client's one round trip)."""

    def hop(p, rid, parts=None):
        if proxy:
            return stream(proxy, p, rid)
        return pd(pre.url, dec.url, p, rid, with_params, parts)

    m0, tok = stream(mono.url, fresh(), f"warm-mono-{label}")
    hop(fresh(), f"warm-{label}")
    ratios, pd_ms, mono_ms, parts = [], [], [], []

    def timed_pd(p, i):
        if not a.breakdown:
            return hop(p, f"{label}-{i}")
        b_pre, b_dec = server_parts(pre.url), server_parts(dec.url)
        row = {}
        out = hop(p, f"{label}-{i}", row)
        time.sleep(SETTLE_S)  # vLLM's metrics trail the request's last step
        row.update(breakdown_of(b_pre, server_parts(pre.url), "prefill"))
        row.update(breakdown_of(b_dec, server_parts(dec.url), "decode"))
        parts.append(row)
        return out

    def timed_mono(p, i):
        before = server_parts(mono.url) if a.breakdown else None
        out = stream(mono.url, p, f"mono-{label}-{i}")
        if a.breakdown:
            time.sleep(SETTLE_S)
            parts[-1].update(breakdown_of(before, server_parts(mono.url), "mono"))
            parts[-1]["client_mono_first_ms"] = out[0] * 1e3
        return out

    def alone(timed, others, p, i):
        """`timed` after SETTLE_S of quiet, with the servers of the side not timed stopped
        (`--other-side paused`): idle, vLLM's NixlConnector pair keeps about half of each core
        busy, the monolithic server's core among them. The client runs the request at the
        priority `--client` gives it."""
        with stopped(others, a.other_side == "paused"):
            time.sleep(SETTLE_S)
            with client_priority(a.client == "realtime"):
                return timed(p, i)

    for i in range(a.pairs):
        p = fresh()
        # The breakdown reads the servers' histograms around each request in turn, P/D first.
        if a.breakdown or i % 2 == 1:
            d, got = alone(timed_pd, [mono], p, i)
            m, want = alone(timed_mono, [pre, dec], p, i)
        else:
            m, want = alone(timed_mono, [pre, dec], p, i)
            d, got = alone(timed_pd, [mono], p, i)
        if got != want:
            raise Failed(f"{label}: pair {i}: P/D gave {got}, monolithic {want}")
        ratios.append(d / m)
        pd_ms.append(d * 1e3)
        mono_ms.append(m * 1e3)
    out = {"ttft_ratio_over_mono": quartiles(ratios), "ttft_ms_median": round(statistics.median(pd_ms), 1),
           "mono_ttft_ms_median": round(statistics.median(mono_ms), 1)}
    if parts:
        out["breakdown_ms_median"] = {k: round(statistics.median(r[k] for r in parts), 2) for k in sorted(parts[0])}
    return out


@contextlib.contextmanager
def client_priority(realtime: bool):
    """The client's thread at a real-time priority (SCHED_FIFO) for the block, as if on a
    machine of its own, then back to the normal policy. On a machine with a core per server, a
    P/D pair's two servers keep both cores busy while its first token travels (prefill stepping
    until decode has read its blocks, decode loading them), where monolithic's client has the
    stopped pair's core to itself: at the normal priority the client's own wait for a core, not
    the serving, made up most of P/D's lead over monolithic (see BENCHMARKS.md)."""
    if not realtime:
        yield
        return
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def realtime_permitted() -> str:
    """Why this process may not run at a real-time priority; empty when it may."""
    try:
        with client_priority(True):
            return ""
    except OSError as e:
        return f"SCHED_FIFO refused ({e}): run as root or raise RLIMIT_RTPRIO (ulimit -r)"


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


PEERS = ("kvconnect-shm", "kvconnect-shm-sync", "kvconnect-shm-async", "kvconnect-tcp", "kvconnect-noload",
         "kvconnect-first", "nixlconnector", "example")


def adapter_build() -> str:
    """How the venv's kvconnect native module was compiled: "release" (`pip install ./python`,
    what users run) or "debug" (maturin's `--profile dev`, as CI builds it), whose calls on
    every request cost several times more: kvconnect's figures need the release build."""
    from kvconnect import _kvconnect

    build = getattr(_kvconnect, "BUILD", "unknown")
    if build != "release":
        print(f"note: kvconnect's native module in this venv is a {build} build; kvconnect's P/D times are "
              "slower than users see (install the release build: pip install ./python)", file=sys.stderr)
    return build


def peer_servers(name: str, model: str, tmp: Path, nixl_python, args=ARGS):
    """(prefill, decode, decode sends prefill's params) of one P/D peer, the servers started
    with `args`. `kvconnect-noload`: the kvconnect pair with decode sent no params, so it
    computes the whole prompt: the cost of the second server's hop without any KV moved.
    `nixlconnector`: vLLM's own connector with the NIXL Python package from `nixl_python` (a
    directory on PYTHONPATH)."""
    if name.startswith("kvconnect-"):
        # kvconnect-first: kvconnect-shm's pair (the proxy in front of it is main's).
        backend = "tcp" if name == "kvconnect-tcp" else "shm"
        inner = nixl(backend)
        if name in ("kvconnect-shm-sync", "kvconnect-shm-async"):
            inner["kv_connector_extra_config"]["load"] = name.rsplit("-", 1)[1]
        pre = Server(f"prefill-{name}", model, tmp, core=0, args=args, whole=True,
                     kv_config=kv_config("kv_producer", nixl(backend), port=free_port()))
        dec = Server(f"decode-{name}", model, tmp, core=1, args=args, whole=True,
                     kv_config=kv_config("kv_consumer", inner),
                     extra_env={"KVCONNECT_LOG": "info,kvconnect_nixl=debug"})
        return pre, dec, name != "kvconnect-noload"
    if name == "nixlconnector":
        conf = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        amx = Path(__file__).resolve().parent / "amx_site"
        path = os.pathsep.join(p for p in (str(nixl_python), str(amx), os.environ.get("PYTHONPATH", "")) if p)
        servers = [Server(f"{role}-{name}", model, tmp, core=core, args=args, kv_config=conf, whole=True,
                          extra_env={"PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
                   for role, core in (("prefill", 0), ("decode", 1))]
        return servers[0], servers[1], True
    store = tmp / "example-storage"
    example = lambda role: {"kv_connector": "ExampleConnector", "kv_role": role,  # noqa: E731
                            "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    pre = Server("prefill-example", model, tmp, core=0, args=args, whole=True, kv_config=example("kv_producer"))
    dec = Server("decode-example", model, tmp, core=1, args=args, whole=True, kv_config=example("kv_consumer"))
    return pre, dec, False


EXTERNAL = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--long-len", type=int, default=480)
    ap.add_argument("--peers", default="kvconnect-shm,kvconnect-tcp,kvconnect-noload,nixlconnector",
                    help=f"comma-separated, of {', '.join(PEERS)}")
    ap.add_argument("--nixl-python", default=os.environ.get("KVCONNECT_NIXL_PYTHON", ""),
                    help="a directory holding the NIXL Python package for vLLM's NixlConnector "
                         "(pip install --target DIR nixl==1.5.1); without it that peer is skipped")
    ap.add_argument("--breakdown", action="store_true",
                    help="also split each P/D request's time into its parts (profiling; the monolithic "
                         "request then always follows the P/D one)")
    ap.add_argument("--other-side", choices=("paused", "running"), default="paused",
                    help="while one side of a pair is timed, the other side's servers are stopped "
                         "(SIGSTOP, then SIGCONT after the request), or left running idle")
    ap.add_argument("--transfer", action="store_true", help="also time one long prompt's pull against a memcpy")
    ap.add_argument("--max-ratio", type=lambda v: [float(x) for x in v.split(",")], default=None,
                    help="a guard: fail when the first peer's median TTFT over monolithic is above this, "
                         "or when it loaded fewer than every prompt token but the last")
    ap.add_argument("--client", choices=("auto", "realtime", "normal"), default="auto",
                    help="the priority of the client's timed requests: real-time (SCHED_FIFO, as if the client "
                         "had a core of its own) or normal (it waits for a core like any process); auto, the "
                         "default: real-time where this process may use it, else normal with a note")
    a = ap.parse_args()
    why = realtime_permitted() if a.client != "normal" else ""
    if why and a.client == "realtime":
        raise SystemExit(f"--client realtime: {why}; or pass --client normal")
    if a.client == "auto":
        a.client = "normal" if why else "realtime"
        if why:
            print(f"note: the client runs at the normal priority: {why}; P/D's times then include the "
                  "client's own wait for a core", file=sys.stderr)
    peers = [p for p in a.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise SystemExit(f"unknown peer '{p}': choose from {', '.join(PEERS)}")
    if "nixlconnector" in peers and not (a.nixl_python and Path(a.nixl_python, "nixl").is_dir()):
        print("skipping nixlconnector: no NIXL Python package (pass --nixl-python DIR after "
              "`pip install --target DIR nixl==1.5.1`)", file=sys.stderr)
        peers.remove("nixlconnector")

    def bench(model: str, tmp: Path):
        rng = random.Random(3)
        fresh = lambda n=a.prompt_len: [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)]  # noqa: E731
        out = {"pairs": a.pairs, "prompt_len": a.prompt_len, "cores": os.cpu_count(), "other_side": a.other_side,
               "client": a.client, "loadavg_start": [round(x, 2) for x in os.getloadavg()], "adapter_build": adapter_build()}
        mono = Server("monolithic", model, tmp, core=0, args=ARGS, whole=True)
        try:
            mono.wait_healthy()
            for name in peers:
                pre, dec, with_params = peer_servers(name, model, tmp, a.nixl_python)
                try:
                    pre.wait_healthy()
                    dec.wait_healthy()
                    ext0 = metric(dec.url, *EXTERNAL)
                    if name == "kvconnect-first":
                        proxy, proxy_url = start_proxy(pre, dec, "--first-token", "prefill", core=dec.core)
                    try:
                        r = interleaved(a, mono, pre, dec, name, with_params, fresh,
                                        proxy_url if name == "kvconnect-first" else None)
                    finally:
                        if name == "kvconnect-first":
                            proxy.terminate()
                            proxy.wait(30)
                    # Every timed request is fresh: what decode loaded, per request.
                    time.sleep(2)  # vLLM's metrics trail the last step
                    r["external_tokens_per_request"] = round((metric(dec.url, *EXTERNAL) - ext0) / (a.pairs + 1), 1)
                    out[name] = r
                    if a.transfer and name.startswith("kvconnect-") and with_params and "transfer" not in out:
                        out["transfer"] = transfer(a, pre, dec, lambda: fresh(a.long_len))
                finally:
                    pre.stop()
                    dec.stop()
        finally:
            mono.stop()
        base = out.get("nixlconnector")
        for name in peers:
            if base and name != "nixlconnector":
                out[name]["over_nixlconnector"] = round(
                    out[name]["ttft_ratio_over_mono"]["median"] / base["ttft_ratio_over_mono"]["median"], 3)
                # By the P/D times alone too: with `--other-side running`, NixlConnector's idle
                # pair keeps stepping on monolithic's core, which slows monolithic in its pairs and
                # so flatters its ratio.
                out[name]["ttft_ms_over_nixlconnector"] = round(out[name]["ttft_ms_median"] / base["ttft_ms_median"], 3)
        out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(out))
        if a.max_ratio is not None:
            for i, name in enumerate(peers):
                r = out[name]
                limit = a.max_ratio[min(i, len(a.max_ratio) - 1)]
                if r["ttft_ratio_over_mono"]["median"] > limit:
                    raise Failed(f"{name}: P/D time to first token is {r['ttft_ratio_over_mono']['median']}x "
                                 f"monolithic at the median, above the guard's {limit}x")
                # Decode loads every prompt token but the last, or, continuing after prefill's
                # token, every prompt token.
                want = a.prompt_len if name == "kvconnect-first" else a.prompt_len - 1
                if name.startswith("kvconnect-") and name != "kvconnect-noload" and r["external_tokens_per_request"] < want:
                    raise Failed(f"{name}: decode loaded {r['external_tokens_per_request']} tokens per request, "
                                 f"fewer than {want} of the prompt's {a.prompt_len}")

    run_checks("bench", False, bench)


if __name__ == "__main__":
    main()

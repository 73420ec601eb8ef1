"""kvconnect P/D inside real vLLM under load, with vLLM's prefix cache on (its default):

- 200 requests of 1 to 4 blocks, a third of them sharing a prefix with another, 8 in flight,
  each sent the way vLLM's P/D proxies send it (prefill with `do_remote_decode` and one token,
  then decode with the params prefill returned, under the same X-Request-Id);
- every output equals a monolithic vLLM server's for the same prompt (also run 8 in flight);
- no load fails, and for every prompt decode's local prefix-cache hits plus the tokens it
  loaded from prefill cover exactly the prompt's tokens before its last
  (vLLM's `vllm:prompt_tokens_by_source_total`), so nothing that could be loaded was
  recomputed, and the prefix cache served what it held.

    VENV/bin/python tests/vllm/test_load.py [--requests 200] [--in-flight 8] [--backends tcp,shm] [--keep]

Each nixl backend runs with decode's `load` at its default (`auto`): asynchronous loads over
tcp, synchronous ones over shm (checked by the adapter's log).
"""

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, Failed, Server, complete, free_port, kv_config, loadable, make_tiny_model, metric, run_checks, serving,
    tokens_of, wait_metric,
)
from test_pd import nixl, pd_complete  # noqa: E402

# The workload as scripts/vllm-tests.sh runs it (in tests/vllm/test_pd.py, on its pairs).
REQUESTS = 200
IN_FLIGHT = 8


def workload(n: int, seed: int = 21) -> list[list[int]]:
    """`n` prompts of 1 to 4 blocks (plus a few tokens); every third one starts with the
    whole blocks of an earlier prompt."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for i in range(n):
        length = rng.randrange(BLOCK, 4 * BLOCK + 8)
        if i % 3 == 2 and out:
            base = rng.choice(out)
            shared = min(len(base) // BLOCK, 2) * BLOCK
            p = base[:shared] + [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(max(1, length - shared))]
        else:
            p = [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(length)]
        out.append(p)
    return out


def by_source(url: str) -> dict[str, float]:
    return {s: metric(url, "vllm:prompt_tokens_by_source_total", f'source="{s}"')
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def run_all(fn, ps, in_flight: int) -> list:
    with ThreadPoolExecutor(in_flight) as pool:
        return list(pool.map(fn, range(len(ps))))


def monolithic_under_load(mono: Server, ps, in_flight: int) -> list:
    """The workload's outputs from a monolithic server, sent `in_flight` at a time as P/D's are."""
    return run_all(lambda i: tokens_of(complete(mono.url, ps[i], f"mono-load-{i}")), ps, in_flight)


def pd_under_load(model: str, tmp: Path, ps, expected, backend: str, in_flight: int):
    """One P/D pair over nixl `backend` started for the workload (check_under_load)."""
    port = free_port()
    pre = Server(f"prefill-load-{backend}", model, tmp, core=0,
                 kv_config=kv_config("kv_producer", nixl(backend), port=port))
    dec = Server(f"decode-load-{backend}", model, tmp, core=1, kv_config=kv_config("kv_consumer", nixl(backend)))
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        check_under_load(pre, dec, ps, expected, backend, in_flight)


def check_under_load(pre: Server, dec: Server, ps, expected, backend: str, in_flight: int):
    """The workload through a running P/D pair over nixl `backend` with decode's `load` at its
    default, `in_flight` at a time; fails on any output that differs from monolithic's, a
    failed load, or reusable KV computed again. Everything is counted from what decode's log
    and /metrics held before the workload, so the pair may have served other requests
    first (tests/vllm/test_pd.py runs this on its own pairs after its checks; their
    prompts share no block with this workload's, so decode's prefix cache holds nothing of
    it beforehand)."""
    before = by_source(dec.url)
    failed0 = metric(dec.url, "vllm:kvconnect_loads_failed_total")
    text0 = dec.text()
    failed_lines0 = text0.count("failed to load its external KV")
    loaded0 = text0.count("loaded its external KV")
    synced0 = text0.count("loaded its external KV synchronously")
    t0 = time.time()
    got = run_all(lambda i: tokens_of(pd_complete(pre.url, dec.url, ps[i], f"load-{backend}-{i}")), ps,
                  in_flight)
    took = time.time() - t0
    wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    if wrong:
        i = wrong[0]
        raise Failed(f"{len(wrong)} of {len(ps)} P/D outputs differ from monolithic; prompt {i} "
                     f"({len(ps[i])} tokens): P/D {got[i]}, monolithic {expected[i]}")
    # Every prompt token but the last: what decode can take from outside its own
    # computation (its prefix cache's whole blocks, the rest loaded).
    reusable = sum(loadable(p) for p in ps)
    failed = metric(dec.url, "vllm:kvconnect_loads_failed_total") - failed0
    ext = wait_metric(dec.url, "vllm:prompt_tokens_by_source_total", before["external_kv_transfer"] + 1,
                      'source="external_kv_transfer"') - before["external_kv_transfer"]
    deadline = time.time() + 60
    while True:
        now = by_source(dec.url)
        d = {k: now[k] - before[k] for k in now}
        if d["local_cache_hit"] + d["external_kv_transfer"] >= reusable or time.time() > deadline:
            break
        time.sleep(1)
    text = dec.text()
    if failed or text.count("failed to load its external KV") != failed_lines0:
        raise Failed(f"{failed:.0f} loads failed under load\n{dec.tail()}")
    # decode's `load` is at its default, `auto`: synchronous over shm, asynchronous over tcp.
    loaded = text.count("loaded its external KV") - loaded0
    synced = text.count("loaded its external KV synchronously") - synced0
    if loaded == 0 or synced != (loaded if backend == "shm" else 0):
        raise Failed(f"{backend}: {synced} of decode's {loaded} loads were synchronous; load \"auto\" makes "
                     f"{'all' if backend == 'shm' else 'none'} of them so\n{dec.tail()}")
    if d["local_cache_hit"] + d["external_kv_transfer"] != reusable or d["external_kv_transfer"] <= 0:
        raise Failed(f"decode took {d['local_cache_hit']:.0f} tokens from its prefix cache and loaded "
                     f"{d['external_kv_transfer']:.0f} (vLLM counted {ext:.0f}); the prompts' tokens "
                     f"before their last are {reusable}: some reusable KV was computed again")
    print(f"ok: {backend}: {len(ps)} P/D requests, {in_flight} in flight, in {took:.1f} s ({synced} of {loaded} "
          f"loads synchronous): all equal monolithic, no "
          f"failed load; decode's prefix cache served {d['local_cache_hit']:.0f} tokens and prefill "
          f"{d['external_kv_transfer']:.0f}, together the {reusable} reusable")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=REQUESTS)
    ap.add_argument("--in-flight", type=int, default=IN_FLIGHT)
    ap.add_argument("--backends", default="tcp,shm", help="nixl backends, one P/D pair each")
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    a = ap.parse_args()

    def checks(model: str, tmp: Path):
        ps = workload(a.requests)
        mono = Server("monolithic-load", model, tmp, core=0)
        with serving(mono):
            mono.wait_healthy()
            expected = monolithic_under_load(mono, ps, a.in_flight)
        print(f"monolithic: {len(ps)} outputs, {a.in_flight} in flight")
        for backend in a.backends.split(","):
            pd_under_load(model, tmp, ps, expected, backend, a.in_flight)

    run_checks("load", a.keep, checks)


if __name__ == "__main__":
    main()

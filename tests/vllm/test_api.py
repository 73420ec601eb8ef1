"""KvconnectConnector's vLLM connector API beyond loads and saves, against real vLLM (CPU):
one server per cache connector, and two nixl P/D pairs: decode loading asynchronously over
tcp, and synchronously (`load: sync`) over shm, each through both checks below:

- `get_block_ids_with_load_errors`: with `"kv_load_failure_policy": "recompute"`, a load that
  fails (prefill's lease expired) is reported by the blocks it was to fill: decode's own
  prefix-cache hit before them is kept and only the failed tokens are recomputed, and the
  output still equals the prefill server's own (monolithic) one. While prefill holds the
  blocks with nothing to compute, its worker's idle steps wait (`idle_step_wait_ms`) for
  most of the hold, as `vllm:kvconnect_idle_wait_seconds_total` shows.
- `handle_preemptions`: decode with 8 usable KV blocks and several P/D requests in flight, so vLLM
  preempts requests that loaded their KV: every output equal, none hangs, and
  `vllm:kvconnect_loads_preempted_total` counts them.
- `reset_cache`: vLLM's `POST /reset_prefix_cache?reset_external=true` empties the
  connector's store: a prompt that loaded its prefix from it before loads nothing after.
- `get_required_kvcache_layout`: asked through vLLM's own `get_kv_connector_cache_layout`, the
  adapter wants HND for nixl and NHD for lmcache on a GPU platform (the platform check
  patched, no server), and nothing on vLLM's CPU backend, whose layout is its own.
- `take_events`: the connector's KV events reach vLLM's KV event publisher as vLLM's own
  `BlockStored` / `BlockRemoved` (read back from vLLM's zmq publisher with vLLM's classes).
- then, on the same lmcache and flexkv servers, tests/vllm/test_cache.py's prefix hit.

    VENV/bin/python tests/vllm/test_api.py [--keep] [--only pd|lmcache|flexkv]

In the cache servers vLLM's own prefix cache is off, so every reused token comes through the
connector and every event on the publisher is the connector's. The P/D pair's reference
outputs are the prefill server's own for the whole request (the same vLLM, model and TP,
computing the prompt itself). Exit status 0 when every check passed.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from harness import (  # noqa: E402
    BLOCK, Failed, KvEvents, Server, complete, external_tokens, free_port, kv_config, loadable, make_tiny_model, metric,
    run_checks, serving, tokens_of, wait_metric,
)
import requests  # noqa: E402
from test_cache import FLEXKV, LMCACHE, check_prefix_hit  # noqa: E402
from test_pd import pd_complete, prefill_params  # noqa: E402

# Prefill holds a request's blocks this long for decode; the load-failure check waits past it.
LEASE_S = 4
# Prompts for the preemption check: lengths around block boundaries, so running requests
# need new blocks while they generate.
PREEMPT_LENS = [95, 127, 63, 159, 96, 120, 100, 150, 70, 127, 190, 64]
IN_FLIGHT = 6
# Decode's KV blocks: one is vLLM's null block, the other 8 hold one request of the longest
# (256 tokens) and no more.
DEC_BLOCKS = 9

PROMPT_LENS = [100, 200]


def run_reset_and_events(model: str, logdir: Path, name: str, inner: dict, tier: str, cache_source: str):
    """reset_cache and take_events on a fresh server with the connector `inner`; then, on the
    same server, tests/vllm/test_cache.py's prefix hit (check_prefix_hit, with prompts of its
    own that share no block with these, counted from what the server had done before), which
    would otherwise take a server of its own with the same connector and vLLM's prefix cache
    off, only without KV events."""
    rng = random.Random(23)
    ps = [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    # Whole stored blocks before each prompt's last token: what a hit loads.
    want = sorted((len(p) - 1) // BLOCK * BLOCK for p in ps)
    port = free_port()
    events = KvEvents(f"tcp://127.0.0.1:{port}", bind=True)
    srv = Server(name, model, logdir, core=0, kv_config=kv_config("kv_both", inner),
                 extra_env={"VLLM_SERVER_DEV_MODE": "1"},
                 args=["--no-enable-prefix-caching", "--kv-events-config",
                       f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                       f'"endpoint": "tcp://127.0.0.1:{port}"}}'])
    with serving(srv):
        srv.wait_healthy()
        first = [tokens_of(complete(srv.url, p, f"first-{i}")) for i, p in enumerate(ps)]
        # The blocks each prompt stores: every whole block of it.
        stored_blocks = sum(len(p) // BLOCK for p in ps)
        stored = events.wait("BlockStored", tier, stored_blocks)
        if len(stored) < stored_blocks:
            raise Failed(f"{name}: vLLM published {len(stored)} connector blocks stored (medium {tier!r}), "
                         f"expected {stored_blocks}; events seen: {events.snapshot()[:10]}\n{srv.tail()}")
        print(f"ok: {name}: {len(stored)} stored blocks reached vLLM's KV event publisher as BlockStored "
              f"(medium {tier!r})")

        # The cache works: a second run loads the stored prefix.
        second = [tokens_of(complete(srv.url, p, f"second-{i}")) for i, p in enumerate(ps)]
        got = sorted(external_tokens(srv.text()))
        if got != want or second != first:
            raise Failed(f"{name}: before the reset the second run loaded {got} tokens (expected {want}), "
                         f"outputs equal: {second == first}\n{srv.tail()}")

        r = requests.post(srv.url + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=60)
        if r.status_code != 200 or r.json().get("success") is not True:
            raise Failed(f"{name}: POST /reset_prefix_cache?reset_external=true: HTTP {r.status_code} "
                         f"{r.text[:300]}\n{srv.tail()}")
        if "kvconnect scheduler: reset_cache: store emptied" not in srv.text():
            raise Failed(f"{name}: the reset did not reach kvconnect's connector\n{srv.tail()}")
        # After the reset the same prompts load nothing from the connector.
        third = [tokens_of(complete(srv.url, p, f"third-{i}")) for i, p in enumerate(ps)]
        after = sorted(external_tokens(srv.text()))
        if after != got:
            raise Failed(f"{name}: after the reset the prompts loaded {after[len(got):] or after} "
                         f"external tokens; the store was not emptied\n{srv.tail()}")
        if third != first:
            raise Failed(f"{name}: after the reset the outputs changed: {first} then {third}")
        print(f"ok: {name}: after the reset the same prompts loaded nothing from the connector, outputs equal")
        # vLLM publishes a step's events with its output: the reset's come with the next step's.
        removed = events.wait("BlockRemoved", tier, len(stored))
        if not stored <= removed:
            raise Failed(f"{name}: after the reset vLLM published {len(removed)} removed blocks, "
                         f"{len(stored - removed)} stored ones not among them")
        print(f"ok: {name}: POST /reset_prefix_cache?reset_external=true emptied the store; "
              f"{len(removed)} blocks reached vLLM as BlockRemoved")
        # Last: its requests would add to the stored blocks and loads counted above.
        check_prefix_hit(srv, name, cache_source)

    events.close()


def check_load_error_blocks(pre: Server, dec: Server):
    """Decode already holds the prompt's first two blocks (its own prefix cache); the load of
    the next ones fails because prefill's lease expired. vLLM must recompute from the first
    block the load was to fill, not from the prompt's start."""
    rng = random.Random(31)
    prompt = [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(150)]
    reference = tokens_of(complete(pre.url, prompt, "ref-lease"))
    # Decode computes the first 70 tokens itself and caches their two whole blocks.
    complete(dec.url, prompt[:70], "warm-lease", max_tokens=1)
    waited0 = metric(pre.url, "vllm:kvconnect_idle_wait_seconds_total")
    sends0 = {k: metric(pre.url, f"vllm:kvconnect_sends_{k}_total") for k in ("done", "expired")}
    params = prefill_params(pre.url, prompt, "pd-lease")
    time.sleep(LEASE_S + 2)
    # Prefill held the blocks with nothing else to do: vLLM kept stepping, and its worker's
    # idle steps waited (idle_step_wait_ms) for most of the lease rather than spinning.
    waited = wait_metric(pre.url, "vllm:kvconnect_idle_wait_seconds_total", waited0 + 0.2 * LEASE_S) - waited0
    if waited < 0.2 * LEASE_S:
        raise Failed(f"lease: prefill's idle steps waited {waited:.2f} s while it held blocks for {LEASE_S} s "
                     "with nothing to compute; they should wait most of it (idle_step_wait_ms)")
    # The hold ended by its lease, not by a consumer: /metrics says so, and counts no send done.
    expired = wait_metric(pre.url, "vllm:kvconnect_sends_expired_total", sends0["expired"] + 1)
    done = metric(pre.url, "vllm:kvconnect_sends_done_total")
    if (expired, done) != (sends0["expired"] + 1, sends0["done"]):
        raise Failed(f"lease: prefill's blocks were freed at the lease's end; vllm:kvconnect_sends_expired_total "
                     f"went {sends0['expired']} -> {expired} (want +1) and sends_done {sends0['done']} -> {done} "
                     "(want unchanged)")
    failed0 = metric(dec.url, "vllm:kvconnect_loads_failed_total")
    got = tokens_of(complete(dec.url, prompt, "pd-lease", kv_transfer_params=params))
    if got != reference:
        raise Failed(f"lease: after a failed load decode gave {got}, the prefill server alone {reference}")
    text = dec.text()
    # vLLM names the request cmpl-<X-Request-Id>-...
    loads = [l for l in text.splitlines() if "-pd-lease-" in l and "kvconnect scheduler: request" in l and " loads " in l]
    want_loaded = loadable(prompt) - 2 * BLOCK
    if not loads or f"loads {want_loaded} external tokens" not in loads[-1]:
        raise Failed(f"lease: decode was to load {want_loaded} tokens after its own 2 cached blocks; "
                     f"its log: {loads}\n{dec.tail()}")
    if not any("-pd-lease-" in l and "failed to load its external KV" in l for l in text.splitlines()):
        raise Failed(f"lease: decode's load did not fail after prefill's {LEASE_S} s lease expired\n{dec.tail()}")
    rec = [l for l in text.splitlines() if "Recovered from KV load failure" in l]
    want = f"1 request(s) rescheduled ({want_loaded} tokens affected)"
    if not rec or want not in rec[-1]:
        raise Failed(f"lease: vLLM's recovery should recompute only the {want_loaded} tokens the load was "
                     f"to fill ({want!r}); its log: {rec}\n{dec.tail()}")
    failed = wait_metric(dec.url, "vllm:kvconnect_loads_failed_total", failed0 + 1)
    if failed < failed0 + 1:
        raise Failed(f"lease: vllm:kvconnect_loads_failed_total stayed {failed}")
    print(f"ok: a load failed after prefill's lease expired; vLLM recomputed only the {want_loaded} tokens "
          f"it was to fill ({rec[-1].split('Recovered from ')[1].strip()}), decode's 2 cached blocks kept, "
          f"output equal; prefill's idle steps waited {waited:.2f} s of its {LEASE_S} s hold, "
          "and counted the hold as expired, not done")


def check_preemptions(pre: Server, dec: Server):
    """Several P/D requests in flight through a decode with 8 usable KV blocks: vLLM preempts some
    after they loaded their KV. Every output equals the prefill server's own."""
    rng = random.Random(37)
    ps = [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in PREEMPT_LENS]
    reference = [tokens_of(complete(pre.url, p, f"ref-pre-{i}")) for i, p in enumerate(ps)]
    with ThreadPoolExecutor(IN_FLIGHT) as ex:
        futs = [ex.submit(pd_complete, pre.url, dec.url, p, f"pd-pre-{i}") for i, p in enumerate(ps)]
        got = [tokens_of(f.result(timeout=600)) for f in futs]
    for i, (g, e) in enumerate(zip(got, reference)):
        if g != e:
            raise Failed(f"preemption: prompt {i} ({len(ps[i])} tokens): P/D gave {g}, the prefill server alone {e}")
    preemptions = metric(dec.url, "vllm:num_preemptions_total")
    logged = dec.text().count("preempted after loading external KV")
    if preemptions < 1 or logged < 1:
        raise Failed(f"preemption: vLLM preempted {preemptions:.0f} requests, {logged} of them after a load; "
                     f"the check needs at least one\n{dec.tail()}")
    counted = wait_metric(dec.url, "vllm:kvconnect_loads_preempted_total", logged)
    if counted != logged:
        raise Failed(f"preemption: vllm:kvconnect_loads_preempted_total is {counted}, decode logged {logged}")
    print(f"ok: {len(ps)} P/D requests, {IN_FLIGHT} in flight, through a decode of 8 usable KV blocks: vLLM preempted "
          f"{preemptions:.0f} times, {logged} requests after loading their KV (counted by "
          "vllm:kvconnect_loads_preempted_total); every output equal, none hung")


def run_pd_api(model: str, logdir: Path, load: str = "async"):
    """`load`: decode's load mode; `sync` runs over shm (a same-host producer, where it is
    meant), so a failed load is told to vLLM by its blocks in the step that computes."""
    port = free_port()
    backend = "shm" if load == "sync" else "tcp"
    nixl = {"kv_connector": "NixlConnector",
            "kv_connector_extra_config": {"backend": backend, "kv_lease_duration": LEASE_S, "kv_lease_max": LEASE_S}}
    pre = Server(f"api-prefill-{load}", model, logdir, core=0, kv_config=kv_config("kv_producer", nixl, port=port))
    dec_cfg = kv_config("kv_consumer", {"kv_connector": "NixlConnector",
                                        "kv_connector_extra_config": {"backend": backend, "load": load}})
    dec_cfg["kv_load_failure_policy"] = "recompute"
    dec = Server(f"api-decode-{load}", model, logdir, core=1, kv_config=dec_cfg,
                 args=["--num-gpu-blocks-override", str(DEC_BLOCKS)])
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        check_load_error_blocks(pre, dec)
        check_preemptions(pre, dec)
        # The synchronous pair really loaded synchronously (the adapter logs each such load),
        # and its failed load was a synchronous one too.
        text = dec.text()
        if load == "sync" and ("loaded its external KV synchronously" not in text
                               or "failed to load its external KV (a synchronous load" not in text):
            raise Failed(f"load sync: decode's loads were not synchronous\n{dec.tail()}")


def check_required_layout(model: str):
    """What vLLM's engine core asks the connector class for before it allocates the KV cache
    (`get_kv_connector_cache_layout`), from a real vLLM config of the tiny model."""
    import unittest.mock

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    nixl = {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": "tcp"}}
    for inner, on_gpu in [(nixl, "HND"), (LMCACHE, "NHD")]:
        kt = KVTransferConfig(**kv_config("kv_consumer", inner))
        cfg = EngineArgs(model=model, block_size=BLOCK, kv_transfer_config=kt).create_engine_config()
        got_cpu = get_kv_connector_cache_layout(cfg)
        with unittest.mock.patch.object(type(current_platform), "is_cpu", lambda self: False):
            got_gpu = get_kv_connector_cache_layout(cfg)
        if (got_cpu, got_gpu) != (None, on_gpu):
            raise Failed(f"{inner['kv_connector']}: the adapter asks vLLM for {got_cpu} on the CPU backend and "
                         f"{got_gpu} on a GPU platform; want None and {on_gpu}")
        print(f"ok: {inner['kv_connector']} asks vLLM for {got_gpu} on a GPU platform, nothing on the CPU backend")


def checks(model: str, tmp: Path, only=None):
    if only in (None, "pd"):
        check_required_layout(model)
        run_pd_api(model, tmp)
        run_pd_api(model, tmp, load="sync")
    for name, inner, tier in [("lmcache", LMCACHE, "cpu_tier"), ("flexkv", FLEXKV, "cpu_tier")]:
        if only in (None, name):
            run_reset_and_events(model, tmp, f"api-{name}", inner, tier, f"{name}_cpu")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    ap.add_argument("--only", choices=["pd", "lmcache", "flexkv"], help="run one connector's checks")
    a = ap.parse_args()
    run_checks("api", a.keep, lambda model, tmp: checks(model, tmp, a.only))


if __name__ == "__main__":
    main()

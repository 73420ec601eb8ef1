"""kvconnect's cache connectors (lmcache, flexkv, the example plugin) inside one real vLLM
server (CPU): the second run of a prompt loads its prefix from kvconnect's cache instead of
computing it, with the same greedy output (lmcache's and flexkv's on tests/vllm/test_api.py's
servers, check_prefix_hit here); and with vLLM's prefix cache on in front of lmcache and
flexkv, each source counted.

    VENV/bin/python tests/vllm/test_cache.py [--keep]

For a prefix hit vLLM's own prefix cache is off, so every reused token comes through the
connector. The load is proven three ways: the adapter's scheduler log, vLLM's own external prefix-cache metric,
and kvconnect's counters on vLLM's /metrics (through the connector stats hooks): tokens and
loads done by cache tier.
Exit status 0 when every check passed.
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, Failed, Server, complete, external_tokens, free_port, kv_config, make_tiny_model, metric, run_checks,
    run_refused_in_process, serving, tokens_of, wait_metric,
)
import requests  # noqa: E402

# Under a block (never stored), one block and a bit, several blocks.
PROMPT_LENS = [20, 40, 100, 200]
LMCACHE = {"kv_connector": "LMCacheConnectorV1",
           "kv_connector_extra_config": {"chunk_size": BLOCK, "max_local_cpu_size": 0.25}}
FLEXKV = {"kv_connector": "FlexKVConnectorV1", "kv_connector_extra_config": {"cpu_cache_gb": 0.25}}


def example_plugin() -> Path:
    """The example plugin cargo built (`cargo build -p kvconnect-plugin-example`), or the file
    KVCONNECT_EXAMPLE_PLUGIN names."""
    env = os.environ.get("KVCONNECT_EXAMPLE_PLUGIN")
    root = Path(__file__).resolve().parents[2]
    path = Path(env) if env else root / "target" / "debug" / "libkvconnect_plugin_example.so"
    if not path.is_file():
        raise Failed(f"no example plugin at {path}: build it with `cargo build -p kvconnect-plugin-example` "
                     "or name it in KVCONNECT_EXAMPLE_PLUGIN")
    return path.resolve()


def run_prefix_hit(model: str, logdir: Path, name: str, inner: dict, cache_source=None, tp: int = 1):
    """A fresh server with vLLM's prefix cache off and the connector `inner` (check_prefix_hit)."""
    srv = Server(name, model, logdir, core=0, kv_config=kv_config("kv_both", inner),
                 args=["--no-enable-prefix-caching"], tp=tp)
    with serving(srv):
        srv.wait_healthy()
        check_prefix_hit(srv, name, cache_source)


def check_prefix_hit(srv: Server, name: str, cache_source=None):
    """Each prompt twice on a running server with vLLM's prefix cache off: equal outputs, and
    the second run loads the whole stored blocks before the prompt's last token.
    `cache_source`: the connector's tier that must have supplied them, as kvconnect's metrics
    name it. Counted from what the server's log and /metrics held before, so the server may
    have served other prompts first (tests/vllm/test_api.py's reset and events checks); these
    prompts share no block with those."""
    rng = random.Random(11)
    ps = [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    if "compat hash" not in srv.text():
        raise Failed(f"{name}: the adapter did not log its negotiated layout\n{srv.tail()}")
    ext0 = len(external_tokens(srv.text()))
    src_label = f'source="{cache_source}"'
    hits0 = metric(srv.url, "vllm:external_prefix_cache_hits_total")
    ext_m0 = metric(srv.url, "vllm:kvconnect_external_tokens_total")
    src0 = metric(srv.url, "vllm:kvconnect_cache_tokens_total", src_label)
    done0 = metric(srv.url, "vllm:kvconnect_loads_done_total")
    by_src0 = metric(srv.url, "vllm:kvconnect_loads_by_source_total", src_label)
    first = [tokens_of(complete(srv.url, p, f"first-{i}")) for i, p in enumerate(ps)]
    if external_tokens(srv.text())[ext0:]:
        raise Failed(f"{name}: the first run loaded external tokens from a cache without these prompts\n{srv.tail()}")
    second = [tokens_of(complete(srv.url, p, f"second-{i}")) for i, p in enumerate(ps)]
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            raise Failed(f"{name}: prompt {i} ({len(ps[i])} tokens): first run {a}, second run {b}")
    # Whole stored chunks, leaving the last prompt token to compute, on block boundaries.
    want = [(len(p) - 1) // BLOCK * BLOCK for p in ps if len(p) > BLOCK]
    got = external_tokens(srv.text())[ext0:]
    if sorted(got) != sorted(want):
        raise Failed(f"{name}: the second run loaded {got} external tokens, expected {want}\n{srv.tail()}")
    total = sum(want)
    vllm_hits = wait_metric(srv.url, "vllm:external_prefix_cache_hits_total", hits0 + total) - hits0
    if vllm_hits != total:
        raise Failed(f"{name}: vLLM's external prefix-cache hits grew by {vllm_hits}, expected {total}")
    ext = wait_metric(srv.url, "vllm:kvconnect_external_tokens_total", ext_m0 + total) - ext_m0
    if ext != total:
        raise Failed(f"{name}: kvconnect's metrics show {ext} external tokens, expected {total}\n{srv.tail()}")
    if cache_source is not None:
        src = wait_metric(srv.url, "vllm:kvconnect_cache_tokens_total", src0 + total, src_label) - src0
        if src != total:
            raise Failed(f"{name}: kvconnect's metrics show {src} tokens from {cache_source}, expected {total}")
        # Each request the cache served is a load done, once, whether the connector loads
        # within the step (lmcache) or asynchronously (flexkv), and counted by its source.
        n = len(want)
        wait_metric(srv.url, "vllm:kvconnect_loads_done_total", done0 + n)
        wait_metric(srv.url, "vllm:kvconnect_loads_by_source_total", by_src0 + n, src_label)
        time.sleep(2)  # a late double count would land by now
        done, by_src = (metric(srv.url, "vllm:kvconnect_loads_done_total") - done0,
                        metric(srv.url, "vllm:kvconnect_loads_by_source_total", src_label) - by_src0)
        if (done, by_src) != (n, n):
            raise Failed(f"{name}: kvconnect's metrics show {done} loads done and {by_src} from {cache_source}, "
                         f"expected {n} each (one per second run that loaded)\n{srv.tail()}")
    print(f"ok: {name} prefix hit inside vLLM: {len(want)} second runs loaded {total} prompt tokens "
          f"from kvconnect's connector (vLLM's external hits {vllm_hits:.0f}), outputs equal")


def by_source(url: str) -> dict[str, float]:
    return {s: metric(url, "vllm:prompt_tokens_by_source_total", f'source="{s}"')
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def run_local_then_connector(model: str, logdir: Path, name: str, inner: dict, cache_source: str):
    """vLLM's own prefix cache on (its default) in front of the connector: a prompt whose first
    two blocks vLLM still holds and whose next two only the connector's store does takes the
    first from vLLM's prefix cache and loads the rest from the connector, each counted under
    its source, output equal to the prompt computed whole."""
    rng = random.Random(17)
    a = [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(4 * BLOCK + 10)]
    c = a[:2 * BLOCK] + [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(20)]
    srv = Server(name, model, logdir, core=0, kv_config=kv_config("kv_both", inner),
                 extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    with serving(srv):
        srv.wait_healthy()
        first = tokens_of(complete(srv.url, a, "local-a-first"))
        # vLLM forgets its own cache; the connector's store keeps prompt a's blocks.
        r = requests.post(srv.url + "/reset_prefix_cache", timeout=60)
        if r.status_code != 200:
            raise Failed(f"{name}: POST /reset_prefix_cache: HTTP {r.status_code} {r.text[:300]}")
        # Prompt c shares a's first two blocks: vLLM's prefix cache holds them again after it.
        complete(srv.url, c, "local-c")
        before = by_source(srv.url)
        src0 = metric(srv.url, "vllm:kvconnect_cache_tokens_total", f'source="{cache_source}"')
        again = tokens_of(complete(srv.url, a, "local-a-again"))
        want_local, want_ext = 2 * BLOCK, (len(a) - 1) // BLOCK * BLOCK - 2 * BLOCK
        wait_metric(srv.url, "vllm:prompt_tokens_by_source_total", before["external_kv_transfer"] + want_ext,
                    'source="external_kv_transfer"')
        d = {k: v - before[k] for k, v in by_source(srv.url).items()}
        src = wait_metric(srv.url, "vllm:kvconnect_cache_tokens_total", src0 + want_ext,
                          f'source="{cache_source}"') - src0
        if again != first:
            raise Failed(f"{name}: prompt a from vLLM's prefix cache and the connector gave {again}, computed {first}")
        if (d["local_cache_hit"], d["external_kv_transfer"], src) != (want_local, want_ext, want_ext):
            raise Failed(f"{name}: prompt a took {d['local_cache_hit']:.0f} tokens from vLLM's prefix cache and "
                         f"{d['external_kv_transfer']:.0f} from outside ({src:.0f} counted for {cache_source}); "
                         f"expected {want_local} and {want_ext}\n{srv.tail()}")
    print(f"ok: {name}: vLLM's prefix cache served {want_local} tokens first and {cache_source} the next "
          f"{want_ext}, each counted under its source, output equal")


def checks(model: str, tmp: Path, only=None):
    if only in (None, "local"):
        run_local_then_connector(model, tmp, "lmcache-local-first", LMCACHE, "lmcache_cpu")
        run_local_then_connector(model, tmp, "flexkv-local-first", FLEXKV, "flexkv_cpu")
    if only == "local":
        return
    # lmcache's and flexkv's prefix hits (check_prefix_hit) run on tests/vllm/test_api.py's
    # servers of each, after its reset and events checks: the same connector config with
    # vLLM's prefix cache off, there with KV events on (which takes a server start less).
    # flexkv stores vLLM's opaque CPU blocks whole (it transposes only blocks whose layout it
    # knows), so it runs there without an adapter.
    plugin = example_plugin()
    run_prefix_hit(model, tmp, "example-plugin", {
        "kv_connector": "example", "kv_connector_module_path": str(plugin),
        "kv_connector_extra_config": {"dir": str(tmp / "example-store")}})
    # (tests/vllm/test_pd.py checks a refusal end to end, through the server's exit.)
    run_refused_in_process(model, [("missing-plugin", kv_config("kv_both", {
        "kv_connector": "example", "kv_connector_module_path": str(tmp / "libmissing.so")}, port=free_port()),
        f"plugin {tmp / 'libmissing.so'}: cannot read it")])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    ap.add_argument("--only", choices=["local"], help="run only vLLM's prefix cache in front of the connectors")
    a = ap.parse_args()
    run_checks("cache", a.keep, lambda model, tmp: checks(model, tmp, a.only))


if __name__ == "__main__":
    main()

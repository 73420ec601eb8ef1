"""kvconnect inside real vLLM servers at tensor-parallel size 2 (vLLM's `mp` executor: one
worker process per rank, each with its own connector over its own rank's KV):

- P/D TP 2 -> TP 2 over nixl (tcp and shm): outputs equal a monolithic TP 2 server's, every
  decode rank loads its share of each prompt's KV from the prefill rank of the same index;
- lmcache and flexkv inside one TP 2 server: a second run of each prompt loads its prefix from
  every rank's own store, outputs equal the first run's;
- TP 2 -> TP 1 (not built inside vLLM): decode says so at ERROR naming both sizes and
  computes the prompt itself, so the output still equals a monolithic TP 1 server's.

    VENV/bin/python tests/vllm/test_tp.py [--keep] [--only pd,cache,mismatch]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Failed, Server, complete, external_tokens, kv_config, run_checks, serving, tokens_of, wait_metric,
)
from test_cache import FLEXKV, LMCACHE, run_prefix_hit  # noqa: E402
from test_pd import nixl, pd_complete, prompts, run_monolithic, run_pd  # noqa: E402
from harness import free_port  # noqa: E402

# Shorter than a block, one and a bit, several.
TP_PROMPT_LENS = [20, 33, 65, 100, 200]


def run_mismatch(model: str, logdir: Path, ps):
    """Prefill at TP 2, decode at TP 1: kvconnect does not move KV between TP sizes inside vLLM
    yet. Decode logs why (both sizes, the remedy) and computes the prompt: no load, no failure,
    output equal to what the same decode server answers the prompt alone (bf16 sums differ
    between TP sizes, so TP 1 is the reference)."""
    port = free_port()
    pre = Server("prefill-tp2-mismatch", model, logdir, core=0,
                 kv_config=kv_config("kv_producer", nixl("tcp"), port=port), tp=2)
    dec = Server("decode-tp1-mismatch", model, logdir, core=1, kv_config=kv_config("kv_consumer", nixl("tcp")))
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        expected_tp1 = [tokens_of(complete(dec.url, p, f"alone-{i}")) for i, p in enumerate(ps)]
        for i, (p, e) in enumerate(zip(ps, expected_tp1)):
            got = tokens_of(pd_complete(pre.url, dec.url, p, f"mismatch-{i}"))
            if got != e:
                raise Failed(f"TP 2 -> 1: prompt {i}: decode gave {got}, monolithic TP 1 {e}")
        text = dec.text()
        want = "comes from a producer at tensor-parallel size 2 and this engine runs at 1"
        lines = [l for l in text.splitlines() if want in l]
        if len(lines) < len(ps) or "--tensor-parallel-size" not in lines[0]:
            raise Failed(f"TP 2 -> 1: decode did not say why it computed each prompt ({len(lines)} lines)\n{dec.tail()}")
        # The decode's own prefix cache holds the prompts from the runs alone; no load.
        refused = wait_metric(dec.url, "vllm:kvconnect_loads_refused_tp_total", len(ps))
        if refused != len(ps):
            raise Failed(f"TP 2 -> 1: /metrics counts {refused:.0f} requests computed for their producer's TP size, "
                         f"expected {len(ps)}")
        if external_tokens(text) or "failed to load its external KV" in text:
            raise Failed(f"TP 2 -> 1: decode loaded or failed a load across TP sizes\n{dec.tail()}")
    print(f"ok: TP 2 -> 1 refused per request with the remedy, prompts computed on decode: {lines[0].strip()[:300]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    ap.add_argument("--only", default="pd,cache,mismatch")
    a = ap.parse_args()
    only = set(a.only.split(","))

    def checks(model: str, tmp: Path):
        ps = prompts(13, TP_PROMPT_LENS)
        if "pd" in only:
            expected = run_monolithic(model, tmp, ps, tp=2)
            for backend in ("tcp", "shm"):
                run_pd(model, tmp, ps, f"tp2-tp2-{backend}", nixl(backend), nixl(backend), expected,
                       shm=backend == "shm", tp=(2, 2))
        if "cache" in only:
            run_prefix_hit(model, tmp, "lmcache-tp2", LMCACHE, cache_source="lmcache_cpu", tp=2)
            run_prefix_hit(model, tmp, "flexkv-tp2", FLEXKV, cache_source="flexkv_cpu", tp=2)
        if "mismatch" in only:
            run_mismatch(model, tmp, ps)

    run_checks("tp", a.keep, checks)


if __name__ == "__main__":
    main()

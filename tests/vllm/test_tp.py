"""kvconnect inside real vLLM servers at tensor-parallel size 2 (vLLM's `mp` executor: one
worker process per rank, each with its own connector over its own rank's KV):

- P/D TP 2 -> TP 2 over nixl (tcp and shm): outputs equal a monolithic TP 2 server's, every
  decode rank loads its share of each prompt's KV from the prefill rank of the same index;
- lmcache and flexkv inside one TP 2 server: a second run of each prompt loads its prefix from
  every rank's own store, outputs equal the first run's;
- P/D TP 2 -> TP 1 and TP 1 -> TP 2 over nixl tcp and shm, between two `kv_both` servers (TP 2 on
  core 0, TP 1 on core 1; each prefills for the other; float32): the TP 1 decode reads half of each
  block's KV heads from each of prefill's two ranks, the TP 2 decode's two ranks each read
  their half from prefill's one rank (which frees the blocks after both). Outputs equal a
  monolithic server at prefill's TP size; where monolithic TP 1 and TP 2 themselves differ
  for a prompt (bf16 sums in another order), the test says so and compares with the
  monolithic server at decode's TP size, which computes every generated token. Decode's
  external tokens are every prompt token but the last, no load fails, none is refused for
  its TP size.

    VENV/bin/python tests/vllm/test_tp.py [--keep] [--only pd,cache,cross]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Failed, Server, complete, external_tokens, kv_config, loadable, metric, run_checks, serving, tokens_of,
    wait_metric,
)
from test_cache import FLEXKV, LMCACHE, run_prefix_hit  # noqa: E402
from test_pd import nixl, pd_complete, prompts, run_monolithic, run_pd  # noqa: E402
from harness import free_port  # noqa: E402

# Shorter than a block, one and a bit, several.
TP_PROMPT_LENS = [20, 33, 65, 100, 200]


# Between TP sizes the servers compute in float32: in bfloat16 the random model's greedy
# tokens already differ between monolithic TP 1 and TP 2 for some prompts (partial sums
# reduced in another order), which would leave those prompts without a reference that
# matches P/D's mix of both sizes.
CROSS_ARGS = ("--dtype", "float32")


def monolithic_both(model: str, logdir: Path, ps) -> dict[int, list]:
    """Every prompt's greedy output from a monolithic server at TP 2 and at TP 1, run side by
    side (one per core)."""
    mono = {2: Server("monolithic-tp2", model, logdir, core=0, tp=2, args=CROSS_ARGS),
            1: Server("monolithic-tp1", model, logdir, core=1, args=CROSS_ARGS)}
    with serving(*mono.values()):
        for srv in mono.values():
            srv.wait_healthy()
        return {tp: [tokens_of(complete(srv.url, p, f"mono-{tp}-{i}")) for i, p in enumerate(ps)]
                for tp, srv in mono.items()}


def check_direction(pre: Server, dec: Server, tps: tuple[int, int], ps, mono: dict[int, list]):
    """P/D of `ps` from `pre` (TP tps[0]) to `dec` (TP tps[1]): outputs, loads, metrics."""
    label = f"TP {tps[0]} -> {tps[1]}"
    src0 = metric(dec.url, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    loaded0 = dec.text().count("loaded its external KV")
    ext0 = len(external_tokens(dec.text()))
    differ = []
    for i, p in enumerate(ps):
        got = tokens_of(pd_complete(pre.url, dec.url, p, f"cross-{tps[0]}{tps[1]}-{i}"))
        want = mono[tps[0]][i]
        if mono[1][i] != mono[2][i]:
            # bf16 sums differ between TP sizes: decode computes every generated token at its
            # own TP size, so that monolithic server is the matching one.
            differ.append(i)
            want = mono[tps[1]][i]
        if got != want:
            raise Failed(f"{label}: prompt {i} ({len(p)} tokens): P/D gave {got}, monolithic at TP "
                         f"{tps[1] if i in differ else tps[0]} {want}")
    if differ:
        print(f"note: {label}: monolithic TP 1 and TP 2 differ for prompts {differ} (bf16 reductions in another "
              f"order); those compared with monolithic TP {tps[1]}")
    ext = external_tokens(dec.text())[ext0:]
    want = [loadable(p) for p in ps if loadable(p)]
    if sorted(ext) != sorted(want):
        raise Failed(f"{label}: decode loaded external tokens {ext}, expected {want}\n{dec.tail()}")
    # Every decode rank finishes its own load of every request.
    loaded = dec.text().count("loaded its external KV") - loaded0
    if loaded != len(want) * tps[1] or "failed to load its external KV" in dec.text():
        raise Failed(f"{label}: decode's {tps[1]} rank(s) finished {loaded} loads for {len(want)} requests, "
                     f"or a load failed\n{dec.tail()}")
    src = wait_metric(dec.url, "vllm:prompt_tokens_by_source_total", src0 + sum(want),
                      'source="external_kv_transfer"') - src0
    if src != sum(want):
        raise Failed(f"{label}: vllm:prompt_tokens_by_source_total{{source=external_kv_transfer}} grew by {src}, "
                     f"expected {sum(want)}")
    print(f"ok: P/D {label} equals monolithic for {len(ps)} prompts; decode loaded {sum(ext)} prompt tokens "
          f"({tps[1]} rank(s) each loading its heads)")


def run_cross(model: str, logdir: Path, ps_21, ps_12, backends):
    """TP 2 -> 1 and TP 1 -> 2 over each of `backends`, between two kv_both servers, each the
    other's prefill; each direction its own prompts (a server's own prefix cache would serve
    the others)."""
    mono = monolithic_both(model, logdir, ps_21 + ps_12)
    n = len(ps_21)
    mono_21 = {tp: out[:n] for tp, out in mono.items()}
    mono_12 = {tp: out[n:] for tp, out in mono.items()}
    for backend in backends:
        run_cross_pair(model, logdir, backend, ps_21, ps_12, mono_21, mono_12)


def run_cross_pair(model: str, logdir: Path, backend: str, ps_21, ps_12, mono_21, mono_12):
    def both(tp: int, core: int) -> Server:
        return Server(f"both-tp{tp}-{backend}", model, logdir, core=core, tp=tp, args=CROSS_ARGS,
                      kv_config=kv_config("kv_both", nixl(backend), port=free_port()))

    two, one = both(2, 0), both(1, 1)
    print(f"nixl over {backend}:")
    with serving(two, one):
        two.wait_healthy()
        one.wait_healthy()
        check_direction(two, one, (2, 1), ps_21, mono_21)
        check_direction(one, two, (1, 2), ps_12, mono_12)
        for s in (one, two):
            refused = metric(s.url, "vllm:kvconnect_loads_refused_tp_total")
            failed = metric(s.url, "vllm:kvconnect_loads_failed_total")
            if refused or failed or "not implemented: this request's KV comes from a producer" in s.text():
                raise Failed(f"{s.name}: {refused:.0f} loads refused for their TP size, {failed:.0f} failed\n{s.tail()}")
        # Prefill at TP 1 frees each block set only once both decode ranks read it: every
        # request it sent ends as a finished send, none at lease expiry.
        sends = wait_metric(one.url, "vllm:kvconnect_sends_done_total", len(ps_12))
        if sends != len(ps_12) or "within its lease; freeing its blocks" in one.text():
            raise Failed(f"TP 1 -> 2: prefill finished {sends:.0f} sends for {len(ps_12)} requests, or freed one at "
                         f"lease expiry\n{one.tail()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    ap.add_argument("--only", default="pd,cache,cross")
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
        if "cross" in only:
            run_cross(model, tmp, ps, prompts(17, TP_PROMPT_LENS), ("tcp", "shm"))

    run_checks("tp", a.keep, checks)


if __name__ == "__main__":
    main()

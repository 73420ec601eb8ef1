"""kvconnect inside real vLLM servers at tensor-parallel size 2 (vLLM's `mp` executor: one
worker process per rank, each with its own connector over its own rank's KV):

- lmcache and flexkv inside one TP 2 server: a second run of each prompt loads its prefix from
  every rank's own store, outputs equal the first run's;
- P/D over nixl tcp and shm among three `kv_both` servers per backend (two at TP 2, on either
  core, and one at TP 1; float32), each direction with prompts of its own:
  - TP 2 -> TP 2: every decode rank loads its share of each prompt's KV from the prefill rank
    of the same index;
  - TP 2 -> TP 1: the TP 1 decode reads half of each block's KV heads from each of prefill's two
    ranks;
  - TP 1 -> TP 2: the TP 2 decode's two ranks each read their half from prefill's one rank,
    which frees the blocks after both.
  Outputs equal a monolithic server at prefill's TP size; where monolithic TP 1 and TP 2
  themselves differ for a prompt (sums reduced in another order), the test says so and
  compares with the monolithic server at decode's TP size, which computes every generated
  token. Decode's external tokens are every prompt token but the last, every decode rank
  finishes its load, decode loads synchronously over shm (`load: auto`) and never over tcp,
  no load fails, none is refused for its TP size, and every prefill finishes each send (none
  at lease expiry). Over shm every server's KV cache is in shared memory, mapped whole, and
  removed when it stops.

    VENV/bin/python tests/vllm/test_tp.py [--keep] [--only cache,pd]
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
from test_pd import check_segments_removed, check_shared_kv, nixl, pd_complete, prompts  # noqa: E402
from harness import free_port  # noqa: E402

# Shorter than a block, one and a bit, several.
TP_PROMPT_LENS = [20, 33, 65, 100, 200]


# The servers compute in float32: in bfloat16 the random model's greedy tokens already differ
# between monolithic TP 1 and TP 2 for some prompts (partial sums reduced in another order),
# which would leave those prompts without a reference that matches P/D's mix of both sizes.
# (P/D in bfloat16 runs at TP 1 in test_pd and test_load.)
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


def check_direction(pre: Server, dec: Server, tps: tuple[int, int], ps, mono: dict[int, list], backend: str):
    """P/D of `ps` from `pre` (TP tps[0]) to `dec` (TP tps[1]) over `backend`: outputs, loads
    and their mode, metrics. Counts from what `dec` had done before."""
    label = f"TP {tps[0]} -> {tps[1]} over {backend}"
    src0 = metric(dec.url, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    loaded0 = dec.text().count("loaded its external KV")
    synced0 = dec.text().count("loaded its external KV synchronously")
    ext0 = len(external_tokens(dec.text()))
    differ = []
    for i, p in enumerate(ps):
        got = tokens_of(pd_complete(pre.url, dec.url, p, f"tp{tps[0]}{tps[1]}-{backend}-{i}"))
        want = mono[tps[0]][i]
        if mono[1][i] != mono[2][i] and tps[0] != tps[1]:
            # The sums differ between TP sizes: decode computes every generated token at its
            # own TP size, so that monolithic server is the matching one.
            differ.append(i)
            want = mono[tps[1]][i]
        if got != want:
            raise Failed(f"{label}: prompt {i} ({len(p)} tokens): P/D gave {got}, monolithic at TP "
                         f"{tps[1] if i in differ else tps[0]} {want}")
    if differ:
        print(f"note: {label}: monolithic TP 1 and TP 2 differ for prompts {differ} (reductions in another "
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
    # `load: auto` (the default) is vLLM's synchronous path over shm, for these small prompts
    # whatever the TP sizes, and never over tcp.
    synced = dec.text().count("loaded its external KV synchronously") - synced0
    if synced != (loaded if backend == "shm" else 0):
        raise Failed(f"{label}: {synced} of decode's {loaded} loads were synchronous, expected "
                     f"{loaded if backend == 'shm' else 0} (load: auto)\n{dec.tail()}")
    src = wait_metric(dec.url, "vllm:prompt_tokens_by_source_total", src0 + sum(want),
                      'source="external_kv_transfer"') - src0
    if src != sum(want):
        raise Failed(f"{label}: vllm:prompt_tokens_by_source_total{{source=external_kv_transfer}} grew by {src}, "
                     f"expected {sum(want)}")
    print(f"ok: P/D {label} equals monolithic for {len(ps)} prompts; decode loaded {sum(ext)} prompt tokens "
          f"({tps[1]} rank(s) each loading its heads{', synchronously' if synced else ''})")


def run_pd_tp(model: str, logdir: Path, ps: dict, backends):
    """P/D TP 2 -> 2, 2 -> 1 and 1 -> 2 over each of `backends`, among three kv_both servers;
    `ps`: each direction's prompts (a server's own prefix cache would serve another's)."""
    order = list(ps)
    mono = monolithic_both(model, logdir, [p for d in order for p in ps[d]])
    at, by_direction = 0, {}
    for d in order:
        by_direction[d] = {tp: out[at:at + len(ps[d])] for tp, out in mono.items()}
        at += len(ps[d])
    for backend in backends:
        run_trio(model, logdir, backend, ps, by_direction)


def run_trio(model: str, logdir: Path, backend: str, ps: dict, mono: dict):
    """Two TP 2 servers (one per core) and a TP 1 server (on the second TP 2's core: those two
    never pair), all kv_both over `backend`: the first TP 2 prefills for the other two, and
    the TP 1 for the first."""
    def both(name: str, tp: int, core: int) -> Server:
        return Server(f"{name}-{backend}", model, logdir, core=core, tp=tp, args=CROSS_ARGS,
                      kv_config=kv_config("kv_both", nixl(backend), port=free_port()))

    two, two_b, one = both("both-tp2", 2, 0), both("both-tp2-b", 2, 1), both("both-tp1", 1, 1)
    servers = (two, two_b, one)
    print(f"nixl over {backend}:")
    with serving(*servers):
        for s in servers:
            s.wait_healthy()
            if "compat hash" not in s.text():
                raise Failed(f"{s.name} did not log its negotiated layout and compat hash\n{s.tail()}")
        check_direction(two, two_b, (2, 2), ps[(2, 2)], mono[(2, 2)], backend)
        check_direction(two, one, (2, 1), ps[(2, 1)], mono[(2, 1)], backend)
        check_direction(one, two, (1, 2), ps[(1, 2)], mono[(1, 2)], backend)
        for s in servers:
            refused = metric(s.url, "vllm:kvconnect_loads_refused_tp_total")
            failed = metric(s.url, "vllm:kvconnect_loads_failed_total")
            if refused or failed or "not implemented: this request's KV comes from a producer" in s.text():
                raise Failed(f"{s.name}: {refused:.0f} loads refused for their TP size, {failed:.0f} failed\n{s.tail()}")
        # Every prefill frees each block set once decode read it (at TP 1 -> 2, once both
        # decode ranks did): every request it sent ends as a finished send, none at lease expiry.
        for s, sent in ((two, len(ps[(2, 2)]) + len(ps[(2, 1)])), (one, len(ps[(1, 2)]))):
            sends = wait_metric(s.url, "vllm:kvconnect_sends_done_total", sent)
            expired = metric(s.url, "vllm:kvconnect_sends_expired_total")
            if sends != sent or expired or "within its lease; freeing its blocks" in s.text():
                raise Failed(f"{s.name}: finished {sends:.0f} sends for {sent} requests, {expired:.0f} at lease "
                             f"expiry\n{s.tail()}")
        segments = {s.name: check_shared_kv(s, s.name, backend == "shm") for s in servers}
    for name, segs in segments.items():
        check_segments_removed(segs, name)
    if backend == "shm":
        print(f"ok: nixl over shm: each server's KV cache was shared memory mapped whole, removed at exit "
              f"({', '.join(f'{n}: {len(v)} segments' for n, v in segments.items())})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    ap.add_argument("--only", default="cache,pd", help="which checks: cache (lmcache and flexkv in a TP 2 "
                    "server), pd (P/D between TP sizes); comma-separated")
    a = ap.parse_args()
    only = set(a.only.split(","))

    if not only or only - {"cache", "pd"}:
        ap.error(f"--only {a.only!r}: give cache and/or pd, comma-separated")

    def checks(model: str, tmp: Path):
        if "cache" in only:
            run_prefix_hit(model, tmp, "lmcache-tp2", LMCACHE, cache_source="lmcache_cpu", tp=2)
            run_prefix_hit(model, tmp, "flexkv-tp2", FLEXKV, cache_source="flexkv_cpu", tp=2)
        if "pd" in only:
            ps = {(2, 2): prompts(13, TP_PROMPT_LENS), (2, 1): prompts(19, TP_PROMPT_LENS),
                  (1, 2): prompts(17, TP_PROMPT_LENS)}
            run_pd_tp(model, tmp, ps, ("tcp", "shm"))

    run_checks("tp", a.keep, checks)


if __name__ == "__main__":
    main()

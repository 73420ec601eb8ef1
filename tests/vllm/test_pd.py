"""kvconnect inside a real vLLM (CPU): prefill/decode through KvconnectConnector equals a
monolithic server, token for token, and decode loads the prompt's KV instead of computing it.

    VENV/bin/python tests/vllm/test_pd.py [--backends tcp,shm] [--keep]

Runs with the venv scripts/install-vllm.sh makes, with kvconnect installed into it
(`VENV/bin/pip install ./python`). Servers run one or two at a time (about 4 GB each).
Exit status 0 when every check passed; the failing check and the servers' log tails otherwise.
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, MAX_TOKENS, Failed, Server, complete, external_tokens, free_port,
    kv_config, make_tiny_model, run_checks, run_refused, serving, tokens_of, wait_log, wait_metric,
)

# Shorter than a block, exactly one, one past, several, and long.
PROMPT_LENS = [5, 20, 31, 32, 33, 63, 64, 65, 96, 100, 150, 200]


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def pd_complete(prefill: str, decode: str, prompt: list[int], request_id: str) -> dict:
    """vLLM's P/D proxy protocol: prefill with do_remote_decode and one token, then decode with
    the kv_transfer_params prefill returned, passed verbatim, under the same X-Request-Id."""
    first = complete(prefill, prompt, request_id, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    params = first.get("kv_transfer_params")
    if not params:
        raise Failed(f"prefill returned no kv_transfer_params for {request_id}: {json.dumps(first)[:400]}")
    return complete(decode, prompt, request_id, kv_transfer_params=params)


def run_monolithic(model: str, logdir: Path, ps) -> list:
    srv = Server("monolithic", model, logdir, core=0)
    with serving(srv):
        srv.wait_healthy()
        return [tokens_of(complete(srv.url, p, f"mono-{i}")) for i, p in enumerate(ps)]


def nixl(backend: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": backend}}


def run_pd(model: str, logdir: Path, ps, label: str, pre_inner: dict, dec_inner: dict, expected: list,
           dec_class: str = "KvconnectConnector"):
    """Prefill and decode servers through the adapter; outputs equal `expected`, decode loads
    the prompts' KV and vLLM's /metrics and stats log show kvconnect's counters."""
    pre = Server(f"prefill-{label}", model, logdir, core=0,
                 kv_config=kv_config("kv_producer", pre_inner, port=free_port()))
    dec = Server(f"decode-{label}", model, logdir, core=1,
                 kv_config=kv_config("kv_consumer", dec_inner, cls=dec_class))
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        for s in (pre, dec):
            if "compat hash" not in s.text():
                raise Failed(f"{s.name} did not log its negotiated layout and compat hash\n{s.tail()}")
        got = [tokens_of(pd_complete(pre.url, dec.url, p, f"pd-{label}-{i}")) for i, p in enumerate(ps)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise Failed(f"{label}: prompt {i} ({len(ps[i])} tokens): P/D gave {g}, monolithic {e}")
        ext = external_tokens(dec.text())
        # vLLM's CPU attention continues a prompt from a block boundary only: decode loads the
        # whole blocks before the prompt's last token and computes the rest.
        want = [(len(p) - 1) // BLOCK * BLOCK for p in ps if len(p) > BLOCK]
        if sorted(ext) != sorted(want):
            raise Failed(f"{label}: decode loaded external tokens {ext}, expected {want} (the whole blocks before each prompt's last token)\n{dec.tail()}")
        loaded = dec.text().count("loaded its external KV")
        if loaded != len(want) or "failed to load its external KV" in dec.text():
            raise Failed(f"{label}: decode's worker finished {loaded} loads for {len(want)} requests, or a load failed\n{dec.tail()}")
        if "handshake accepted" not in dec.text():
            raise Failed(f"{label}: decode never handshook with prefill\n{dec.tail()}")
        # kvconnect's counters reach vLLM's /metrics through the connector stats hooks.
        n, total = len(want), sum(want)
        loads = wait_metric(dec.url, "vllm:kvconnect_loads_done_total", n)
        ext_m = wait_metric(dec.url, "vllm:kvconnect_external_tokens_total", total)
        vllm_ext = wait_metric(dec.url, "vllm:external_prefix_cache_hits_total", total)
        # Prefill holds every request's blocks for decode, loaded or not (decode computes a
        # prompt shorter than a block itself and releases it).
        sends = wait_metric(pre.url, "vllm:kvconnect_sends_done_total", len(ps))
        if (loads, ext_m, vllm_ext, sends) != (n, total, total, len(ps)):
            raise Failed(f"{label}: /metrics show decode loads {loads}, kvconnect external tokens {ext_m}, "
                         f"vLLM external prefix-cache hits {vllm_ext}, prefill sends {sends}; expected {n}, "
                         f"{total}, {total}, {len(ps)}")
        if not wait_log(dec, "KV Transfer metrics: kvconnect_"):
            raise Failed(f"{label}: vLLM's stats log never showed kvconnect's transfer metrics\n{dec.tail()}")
        print(f"ok: P/D over {label} equals monolithic for {len(ps)} prompts; decode loaded {sum(ext)} prompt tokens")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="tcp")
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    a = ap.parse_args()

    def checks(model: str, tmp: Path):
        ps = prompts()
        expected = run_monolithic(model, tmp, ps)
        print(f"monolithic: {len(expected)} greedy outputs of {MAX_TOKENS} tokens")
        for backend in a.backends.split(","):
            run_pd(model, tmp, ps, f"nixl-{backend}", nixl(backend), nixl(backend), expected)
        # The composite on prefill, a plain transport on decode, each negotiating alone; decode
        # through the HMA-capable class, so vLLM keeps its hybrid KV cache manager on there and
        # off on prefill (lmcache lacks it). On a model with one attention kind the KV cache
        # groups agree anyway, so the handshake accepts the pair.
        composite = {"kv_connector": "PdConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {"chunk_size": BLOCK}},
            nixl("tcp")]}}
        run_pd(model, tmp, ps, "composite", composite, nixl("tcp"), expected, dec_class="KvconnectHmaConnector")
        run_refused(model, tmp, "hma-class-over-lmcache", {"kv_connector": "LMCacheConnectorV1"},
                    "name KvconnectConnector instead of KvconnectHmaConnector", cls="KvconnectHmaConnector")
        run_refused(model, tmp, "unknown-connector", {"kv_connector": "NoSuchConnector"},
                    "no connector named 'NoSuchConnector'")
        run_refused(model, tmp, "shm-backend", {"kv_connector": "NixlConnector",
                    "kv_connector_extra_config": {"backend": "shm"}}, "not implemented: the nixl backend 'shm'")
        # flexkv works in NHD and would transpose into vLLM's CPU blocks, which are opaque.
        run_refused(model, tmp, "adapter-over-opaque", {"kv_connector": "FlexKVConnectorV1"},
                    "the engine's KV blocks are opaque")

    run_checks("pd", a.keep, checks)


if __name__ == "__main__":
    main()

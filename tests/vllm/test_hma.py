"""DYN-3545 inside a real vLLM (CPU), on a tiny Gemma-3-like model whose first layer attends
through a sliding window (two attention kinds, so the hybrid KV cache manager makes two KV
cache groups).

    VENV/bin/python tests/vllm/test_hma.py [--keep]

1. Prefill on PdConnector[LMCache, NIXL] through KvconnectConnector: lmcache lacks HMA, so
   vLLM turns its hybrid KV cache manager off. Decode on plain NIXL through
   KvconnectHmaConnector: vLLM keeps it on. Decode's handshake refuses the pair before any
   KV moves; the request fails (HTTP 500, not a silent recompute) and decode's report for
   that request carries `hma: prefill=off ..., decode=on ...` and the remedy.
2. With one deployment file for both (joint negotiation): a decode through
   KvconnectHmaConnector refuses to start, naming lmcache; through KvconnectConnector both
   start, each predicts the other's compat hash, and outputs equal a monolithic server's: the
   first pair's decode alone (HMA on), asked after its refused request.
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, Failed, Server, compat_hash, complete, external_tokens, free_port, joint_peer_hash, kv_config, loadable,
    make_tiny_model, run_checks, serving, tokens_of, wait_log, write_deployment,
)
from test_pd import nixl, pd_complete  # noqa: E402
import requests  # noqa: E402

PROMPT_LENS = [40, 100, 200]
COMPOSITE = {"kv_connector": "PdConnector", "kv_connector_extra_config": {"connectors": [
    {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {"chunk_size": BLOCK}},
    nixl("tcp")]}}


def pair(model: str, logdir: Path, label: str, dec_class: str, deployment=None):
    joint = {} if deployment is None else {"deployment": str(deployment)}
    pre = Server(f"prefill-{label}", model, logdir, core=0,
                 kv_config=kv_config("kv_producer", None if joint else COMPOSITE, port=free_port(), **joint))
    dec = Server(f"decode-{label}", model, logdir, core=1,
                 kv_config=kv_config("kv_consumer", None if joint else nixl("tcp"), cls=dec_class, **joint))
    return pre, dec


def refused_at_the_handshake(model: str, tmp: Path, ps) -> list:
    """Returns each prompt's greedy output from the mismatched decode server alone, asked once
    the refused request failed: a monolithic server's (vLLM with its hybrid KV cache manager
    on; the connector moves nothing for a request without kv_transfer_params, and the check
    above saw decode load nothing)."""
    pre, dec = pair(model, tmp, "mismatch", "KvconnectHmaConnector")
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        if "hma on" not in dec.text() or "hma off" not in pre.text():
            raise Failed(f"expected decode negotiated with HMA on and prefill with it off\n{pre.tail()}\n{dec.tail()}")
        try:
            pd_complete(pre.url, dec.url, ps[1], "dyn3545-mismatch")
            raise Failed("the mismatched pair served the request")
        except Failed as e:
            # vLLM answers a request whose KV load failed with 500 and no detail of its own.
            if "HTTP 500" not in str(e):
                raise
        if not wait_log(dec, "failed to load its external KV", timeout=30):
            raise Failed(f"decode reported no failed load for the refused request\n{dec.tail()}")
        # The failed request's report: which request, the field diff and the remedies.
        line = next(l for l in dec.text().splitlines()
                    if "dyn3545-mismatch" in l and "failed to load its external KV" in l)
        for want in ["hma: prefill=off", "decode=on", "hybrid_kv_cache_manager=off on decode",
                     "name KvconnectConnector on decode", "(handshake_refused)"]:
            if want not in line:
                raise Failed(f"the failed request's report lacks {want!r}: {line}")
        # The failed load is reported by request (block ids are per KV cache group with HMA
        # on): decode stays up and serves the next request.
        if "EngineDeadError" in dec.text() or requests.get(dec.url + "/health", timeout=30).status_code != 200:
            raise Failed(f"decode's engine died after the refused handshake\n{dec.tail()}")
        if "loaded its external KV" in dec.text():
            raise Failed(f"decode loaded KV from a prefill engine it refused\n{dec.tail()}")
        print(f"ok: DYN-3545 refused at the handshake; the request failed with: {line.strip()[:500]}")
        expected = [tokens_of(complete(dec.url, p, f"mono-{i}")) for i, p in enumerate(ps)]
    return expected


def joint(model: str, tmp: Path, ps, expected):
    dep = write_deployment(tmp / "dyn3545.toml", model, COMPOSITE, nixl("tcp"))
    srv = Server("decode-joint-hma", model, tmp, core=1, kv_config=kv_config(
        "kv_consumer", None, cls="KvconnectHmaConnector", deployment=str(dep)))
    with serving(srv):
        status = srv.wait_exit(420)
        want = "does not support the hybrid KV cache manager"
        line = next((l for l in srv.text().splitlines() if want in l and "KvconnectError" in l), None)
        if status == 0 or line is None or "prefill child 'lmcache'" not in line or "name KvconnectConnector" not in line:
            raise Failed(f"decode with HMA on did not refuse the joint deployment naming lmcache\n{srv.tail()}")
        print(f"ok: with the joint deployment, decode refused at startup: {line.strip()[:400]}")

    pre, dec = pair(model, tmp, "joint", "KvconnectConnector", deployment=dep)
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        hp, hd = compat_hash(pre.text()), compat_hash(dec.text())
        if hp != hd or joint_peer_hash(pre.text()) != hd or joint_peer_hash(dec.text()) != hp:
            raise Failed(f"joint negotiation: prefill {hp}, decode {hd}, predicted "
                         f"{joint_peer_hash(pre.text())} / {joint_peer_hash(dec.text())}")
        got = [tokens_of(pd_complete(pre.url, dec.url, p, f"dyn3545-joint-{i}")) for i, p in enumerate(ps)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise Failed(f"joint pair: prompt {i} ({len(ps[i])} tokens): P/D gave {g}, a server alone {e}")
        want = [loadable(p) for p in ps]
        if sorted(external_tokens(dec.text())) != sorted(want):
            raise Failed(f"joint pair: decode loaded {external_tokens(dec.text())} external tokens, expected {want}\n{dec.tail()}")
        print(f"ok: with the joint deployment both start (compat hash {hp[:12]} on both) and equal monolithic "
              f"for {len(ps)} prompts")


def checks(model: str, tmp: Path):
    rng = random.Random(5)
    ps = [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = refused_at_the_handshake(model, tmp, ps)
    joint(model, tmp, ps, expected)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    run_checks("hma", ap.parse_args().keep, checks, kind="sliding")


if __name__ == "__main__":
    main()

"""DYN-3545 inside a real vLLM (CPU), on a tiny Gemma-3-like model whose first layer attends
through a sliding window (two attention kinds, so the hybrid KV cache manager makes two KV
cache groups).

    VENV/bin/python tests/vllm/test_hma.py [--keep]

1. Prefill on PdConnector[LMCache, NIXL] through KvconnectConnector: lmcache lacks HMA, so
   vLLM turns its hybrid KV cache manager off. Decode on plain NIXL through
   KvconnectHmaConnector: vLLM keeps it on. Decode's handshake refuses the pair before any
   KV moves, with `hma: prefill=off ..., decode=on ...` and the remedy in its log.
2. The same prefill with decode through KvconnectConnector (HMA off on both): the pair is
   accepted and outputs equal a monolithic server's.
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, Failed, Server, external_tokens, free_port, kv_config, make_tiny_model,
    run_checks, serving, tokens_of, wait_log,
)
from test_pd import nixl, pd_complete, run_monolithic  # noqa: E402
import requests  # noqa: E402

PROMPT_LENS = [40, 100, 200]
COMPOSITE = {"kv_connector": "PdConnector", "kv_connector_extra_config": {"connectors": [
    {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {"chunk_size": BLOCK}},
    nixl("tcp")]}}


def pair(model: str, logdir: Path, label: str, dec_class: str):
    pre = Server(f"prefill-{label}", model, logdir, core=0,
                 kv_config=kv_config("kv_producer", COMPOSITE, port=free_port()))
    dec = Server(f"decode-{label}", model, logdir, core=1,
                 kv_config=kv_config("kv_consumer", nixl("tcp"), cls=dec_class))
    return pre, dec


def checks(model: str, tmp: Path):
    rng = random.Random(5)
    ps = [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = run_monolithic(model, tmp, ps)

    pre, dec = pair(model, tmp, "mismatch", "KvconnectHmaConnector")
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        if "hma on" not in dec.text() or "hma off" not in pre.text():
            raise Failed(f"expected decode negotiated with HMA on and prefill with it off\n{pre.tail()}\n{dec.tail()}")
        try:
            pd_complete(pre.url, dec.url, ps[1], "dyn3545-mismatch")
        except Failed as e:
            print(f"  (the mismatched request failed: {str(e)[:200]})")
        want = "hma: prefill=off"
        if not wait_log(dec, want, timeout=30) or "decode=on" not in dec.text():
            raise Failed(f"decode did not refuse the pair with {want!r} ... decode=on\n{dec.tail()}")
        line = next(l for l in dec.text().splitlines() if want in l)
        # The failed load is reported by request (block ids are per KV cache group with HMA
        # on): decode stays up and serves the next request.
        if "EngineDeadError" in dec.text() or requests.get(dec.url + "/health", timeout=30).status_code != 200:
            raise Failed(f"decode's engine died after the refused handshake\n{dec.tail()}")
        if external_tokens(dec.text()) and "loaded its external KV" in dec.text():
            raise Failed(f"decode loaded KV from a prefill engine it refused\n{dec.tail()}")
        print(f"ok: DYN-3545 refused at the handshake: {line.strip()[:400]}")

    pre, dec = pair(model, tmp, "matched", "KvconnectConnector")
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        got = [tokens_of(pd_complete(pre.url, dec.url, p, f"dyn3545-ok-{i}")) for i, p in enumerate(ps)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise Failed(f"matched pair: prompt {i} ({len(ps[i])} tokens): P/D gave {g}, monolithic {e}")
        want = [(len(p) - 1) // BLOCK * BLOCK for p in ps]
        if sorted(external_tokens(dec.text())) != sorted(want):
            raise Failed(f"matched pair: decode loaded {external_tokens(dec.text())} external tokens, expected {want}\n{dec.tail()}")
        print(f"ok: with HMA off on both, the composite prefill and NIXL decode equal monolithic for {len(ps)} prompts")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    run_checks("hma", ap.parse_args().keep, checks, kind="sliding")


if __name__ == "__main__":
    main()

"""kvconnect inside a real vLLM (CPU): prefill/decode through KvconnectConnector equals a
monolithic server, token for token, and decode loads the prompt's KV instead of computing it.
Then tests/vllm/test_load.py's 200 requests, 8 in flight, through the same shm and tcp pairs
(part `load`), against the same monolithic server.

    VENV/bin/python tests/vllm/test_pd.py [--backends shm,tcp] [--parts pd,load,composite,refused] [--keep]

Runs with the venv scripts/install-vllm.sh makes, with kvconnect installed into it
(`VENV/bin/pip install ./python`). Servers run one or two at a time (about 4 GB each).
Exit status 0 when every check passed; the failing check and the servers' log tails otherwise.
"""

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, MAX_TOKENS, Failed, Server, compat_hash, complete, external_tokens, free_port, joint_peer_hash, loadable,
    kv_config, make_tiny_model, metric, run_checks, run_refused, run_refused_in_process, serving, tokens_of, wait_log,
    wait_metric, write_deployment,
)
import requests  # noqa: E402

# Shorter than a block, exactly one, one past, several, and long.
PROMPT_LENS = [5, 20, 31, 32, 33, 63, 64, 65, 96, 100, 150, 200]


def prompts(seed: int = 7, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in lens]


# Fresh prompts for the requests through kvconnect proxy (decode's own prefix cache holds
# the others by then).
PROXY_PROMPT_LENS = [20, 33, 64, 100, 150, 200]


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


def run_monolithic(model: str, logdir: Path, ps, tp: int = 1, under_load=None):
    """The greedy outputs of `ps` from a monolithic server, one request at a time. `under_load`:
    (prompts, in flight): their outputs too, sent that many at a time (test_load's
    workload), returned as a second list."""
    srv = Server(f"monolithic-tp{tp}", model, logdir, core=0, tp=tp)
    with serving(srv):
        srv.wait_healthy()
        out = [tokens_of(complete(srv.url, p, f"mono-{i}")) for i, p in enumerate(ps)]
        if under_load is None:
            return out
        from test_load import monolithic_under_load
        return out, monolithic_under_load(srv, *under_load)


def nixl(backend: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": backend}}


def prefill_params(prefill: str, prompt: list[int], request_id: str) -> dict:
    """The kv_transfer_params prefill returns for `prompt` (vLLM's protocol, one token)."""
    first = complete(prefill, prompt, request_id, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return first["kv_transfer_params"]


def check_unlisted_producer(pre: Server, dec: Server, label: str, prompt: list[int]):
    """Params that point decode at a producer its kv_producers does not list (a client
    rewrote remote_port): the request fails, decode contacts nothing and stays up."""
    with socket.socket() as lure:
        lure.bind(("127.0.0.1", 0))
        lure.listen(4)
        lure.settimeout(3)
        params = dict(prefill_params(pre.url, prompt, f"pd-{label}-lure"), remote_port=lure.getsockname()[1])
        try:
            complete(dec.url, prompt, f"pd-{label}-lure", kv_transfer_params=params)
            raise Failed(f"{label}: decode served a request whose producer is outside kv_producers")
        except Failed as e:
            if "HTTP 500" not in str(e):
                raise
        try:
            lure.accept()
            raise Failed(f"{label}: decode connected to a producer outside kv_producers")
        except socket.timeout:
            pass
    line = next((l for l in dec.text().splitlines() if "lure" in l and "failed to load its external KV" in l), "")
    if "which kv_producers does not list; nothing was contacted" not in line or "producer_not_allowed" not in line:
        raise Failed(f"{label}: decode's failure report for the unlisted producer: {line!r}\n{dec.tail()}")
    print(f"ok: {label}: a producer outside kv_producers refused without a connection: {line.strip()[:300]}")


def kvconnect_bin() -> Path:
    """The kvconnect binary cargo built (`cargo build -p kvconnect-host`), or KVCONNECT_BIN."""
    env = os.environ.get("KVCONNECT_BIN")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "target" / "debug" / "kvconnect"
    if not path.is_file():
        raise Failed(f"no kvconnect binary at {path}: build it with `cargo build -p kvconnect-host` or name it in KVCONNECT_BIN")
    return path


def start_proxy(pre: Server, dec: Server, *flags: str, core=None):
    """`kvconnect proxy` in front of the two servers: (the process, its URL). `core`: the CPU
    every thread of the proxy runs on (None: wherever the kernel puts them)."""
    pin = ["taskset", "-c", str(core)] if core is not None else []
    proxy = subprocess.Popen([*pin, str(kvconnect_bin()), "proxy", "--prefill", pre.url, "--decode", dec.url,
                              "--listen", "127.0.0.1:0", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    first = proxy.stdout.readline()
    if not first:
        raise Failed(f"kvconnect proxy did not start: {proxy.stderr.read()[:500]}")
    return proxy, json.loads(first)["proxy"]


def stream_through(url: str, body: dict, label: str):
    """(every streamed token id, the usage chunk's usage, the first chunk) of one streamed
    completion."""
    body = dict(body, model="tiny", temperature=body.get("temperature", 0.0), stream=True, return_token_ids=True)
    tokens, usage, first = [], None, None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        if r.status_code != 200:
            raise Failed(f"{label}: streaming through kvconnect proxy: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise Failed(f"{label}: the stream carried an error: {chunk}")
                first = first or chunk
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    tokens += c.get("token_ids") or []
    return tokens, usage, first


def check_kvconnect_proxy(pre: Server, dec: Server, label: str, ps, expected: list, fresh=None, fresh_expected=None):
    """`kvconnect proxy` in front of the two vLLM servers: plain OpenAI requests through it
    (the last one streamed) equal monolithic, and decode loads each prompt's KV. `fresh`:
    prompts for the same through `--first-token prefill` (check_first_token)."""
    ext0 = metric(dec.url, "vllm:external_prefix_cache_hits_total")
    sends0 = metric(pre.url, "vllm:kvconnect_sends_done_total")
    # vLLM's protocol for every request: decode computes each prompt's last token.
    proxy, url = start_proxy(pre, dec, "--first-token", "decode")
    try:
        for i, (p, e) in enumerate(zip(ps[:-1], expected)):
            got = tokens_of(complete(url, p, f"proxy-{label}-{i}"))
            if got != e:
                raise Failed(f"{label}: through kvconnect proxy, prompt {i} ({len(p)} tokens) gave {got}, monolithic {e}")
        streamed, _, _ = stream_through(url, {"prompt": ps[-1], "max_tokens": MAX_TOKENS, "ignore_eos": True}, label)
        if streamed != expected[-1]:
            raise Failed(f"{label}: streamed through kvconnect proxy: {streamed}, monolithic {expected[-1]}")
    finally:
        proxy.terminate()
        proxy.wait(30)
    want = sum(loadable(p) for p in ps)
    ext = wait_metric(dec.url, "vllm:external_prefix_cache_hits_total", ext0 + want) - ext0
    if ext != want:
        raise Failed(f"{label}: through kvconnect proxy decode's external prefix-cache hits grew by {ext}, expected {want}")
    # Every request's send is counted before the next part counts its own (vLLM publishes
    # the connector's stats a step or more after they happen).
    sends = wait_metric(pre.url, "vllm:kvconnect_sends_done_total", sends0 + len(ps)) - sends0
    if sends != len(ps):
        raise Failed(f"{label}: through kvconnect proxy prefill finished {sends} sends, expected {len(ps)}")
    print(f"ok: {label}: {len(ps)} requests through kvconnect proxy (one streamed) equal monolithic; decode loaded {ext:.0f} prompt tokens")
    if fresh:
        check_first_token(pre, dec, label, fresh, fresh_expected)


def check_first_token(pre: Server, dec: Server, label: str, ps, expected: list):
    """`kvconnect proxy` (its default, `--first-token prefill`): each streamed completion starts with
    prefill's token and equals monolithic's, its usage is the client's (prompt and
    completion tokens as monolithic counts them), and decode loads the KV of every prompt
    token, computing only prefill's token. A one-token request is prefill's alone (decode
    loads nothing); a seeded one goes vLLM's two-request way, counted by why; one whose first
    token is a stop token ends with it, and decode still reads prefill's blocks, freeing them.
    After a lull longer than prefill's idle_timeout and the proxy's pooled connections' idle
    limit, the next completion still starts with prefill's token and decode loads its KV."""
    (ps, idle_prompt, seeded_prompt, stop_prompt) = (ps[:-3], ps[-3], ps[-2], ps[-1])
    (expected, idle_expected, seeded_expected, stop_expected) = (expected[:-3], expected[-3], expected[-2], expected[-1])
    ext0 = metric(dec.url, "vllm:external_prefix_cache_hits_total")
    sends0 = metric(pre.url, "vllm:kvconnect_sends_done_total")
    proxy, url = start_proxy(pre, dec)
    try:
        for i, (p, e) in enumerate(zip(ps, expected)):
            body = {"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            got, usage, first = stream_through(url, body, f"{label} first token from prefill, prompt {i}")
            if got != e:
                raise Failed(f"{label}: first token from prefill, prompt {i} ({len(p)} tokens) gave {got}, monolithic {e}")
            want_usage = {"prompt_tokens": len(p), "completion_tokens": MAX_TOKENS, "total_tokens": len(p) + MAX_TOKENS}
            if {k: (usage or {}).get(k) for k in want_usage} != want_usage:
                raise Failed(f"{label}: first token from prefill, prompt {i}: usage {usage}, expected {want_usage}")
            if first["choices"][0].get("prompt_token_ids") != p or first["choices"][0].get("token_ids") != e[:1]:
                raise Failed(f"{label}: first token from prefill, prompt {i}: the first chunk is {first}")
        # A lull past prefill's idle_timeout (1 s here) and the proxy's pool idle limit (4 s).
        time.sleep(5)
        got, usage, first = stream_through(url, {"prompt": idle_prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True},
                                           f"{label} first token from prefill after a lull")
        if got != idle_expected or first["choices"][0].get("token_ids") != idle_expected[:1]:
            raise Failed(f"{label}: first token from prefill after a lull gave {got} (first chunk {first}), "
                         f"monolithic {idle_expected}")
        ps, expected = ps + [idle_prompt], expected + [idle_expected]
        ext = wait_metric(dec.url, "vllm:external_prefix_cache_hits_total", ext0 + sum(map(len, ps))) - ext0
        if ext != sum(map(len, ps)):
            raise Failed(f"{label}: first token from prefill: decode's external prefix-cache hits grew by {ext}, "
                         f"expected every prompt token, {sum(map(len, ps))}")
        # One token: prefill's answer is the whole answer, and prefill keeps no KV for it.
        one, _, _ = stream_through(url, {"prompt": ps[0], "max_tokens": 1}, f"{label} one token")
        seeded, _, _ = stream_through(url, {"prompt": seeded_prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                            "seed": 7}, f"{label} seeded")
        if (one, seeded) != (expected[0][:1], seeded_expected):
            raise Failed(f"{label}: through --first-token prefill, one token gave {one}, a seeded request {seeded}; "
                         f"monolithic {expected[0][:1]}, {seeded_expected}")
        body = {"prompt": stop_prompt, "max_tokens": MAX_TOKENS, "stop_token_ids": [stop_expected[0]]}
        stopped, _, first = stream_through(url, body, f"{label} stopped at the first token")
        if stopped != stop_expected[:1] or first["choices"][0].get("finish_reason") != "stop":
            raise Failed(f"{label}: a request stopped at its first token gave {stopped}, first chunk {first}")
        text = requests.get(url + "/metrics", timeout=10).text
        counts = {k: sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("kvconnect_proxy_first_token_total{") and k in l)
                  for k in ('from="prefill"', 'reason="parameters"')}
        if counts != {'from="prefill"': len(ps) + 2, 'reason="parameters"': 1}:
            raise Failed(f"{label}: the proxy counted first tokens {counts}, expected {len(ps) + 2} from prefill and the "
                         f"seeded request from decode (parameters)")
        # The seeded request and the stopped one's release loaded their KV (every token but the
        # last); the one-token request kept none.
        want = loadable(seeded_prompt) + loadable(stop_prompt)
        ext2 = wait_metric(dec.url, "vllm:external_prefix_cache_hits_total", ext0 + ext + want) - ext0 - ext
        sends = wait_metric(pre.url, "vllm:kvconnect_sends_done_total", sends0 + len(ps) + 2) - sends0
        expired = metric(pre.url, "vllm:kvconnect_sends_expired_total")
        if (ext2, sends, expired) != (want, len(ps) + 2, 0):
            raise Failed(f"{label}: after the one-token, seeded and stopped requests decode's external hits grew by {ext2} "
                         f"and prefill finished {sends} sends ({expired} ended by the lease); expected {want} and "
                         f"{len(ps) + 2} (0)")
        print(f"ok: {label}: {len(ps)} streamed completions through --first-token prefill equal monolithic, with "
              f"monolithic's usage; decode loaded every prompt token ({ext:.0f}); one token from prefill alone, "
              f"a seeded request the two-request way, one stopped at its first token freed prefill's blocks, "
              f"and one after a 5 s lull loaded its KV")
    finally:
        # Only now: the stopped request's release runs in the proxy's background.
        proxy.terminate()
        proxy.wait(30)


def run_pd(model: str, logdir: Path, ps, label: str, pre_inner, dec_inner, expected: list,
           dec_class: str = "KvconnectConnector", shm: bool = False, pre_adapter=None, dec_adapter=None,
           lure: bool = False, via_proxy=None, tp=(1, 1), idle=None, joint_dec=None, load=None):
    """Prefill and decode servers through the adapter; outputs equal `expected`, decode loads
    the prompts' KV and vLLM's /metrics and stats log show kvconnect's counters. `lure`:
    decode lists prefill as its only producer and is sent params naming another. `tp`:
    prefill's and decode's tensor-parallel sizes. `idle`: (prompt, its monolithic output):
    after the others, sent once the link decode keeps to prefill has sat idle past prefill's
    `idle_timeout` (set in `pre_inner`). `load`: (prompts, their monolithic outputs, in flight):
    test_load's workload through the pair after the other checks (test_load.check_under_load,
    which counts from what the pair had done before it)."""
    port = free_port()
    dec_adapter = dict(dec_adapter or {})
    if lure:
        dec_adapter["kv_producers"] = [f"127.0.0.1:{port}"]
        # A port copied onto decode, where it means nothing: warned about, never served.
        dec_adapter["side_channel_port"] = free_port()
    # With `idle`, prefill logs its idle closes (at debug), so the check sees the link was closed.
    pre_env = {"KVCONNECT_LOG": "info,kvconnect_nixl::producer=debug"} if idle else None
    pre = Server(f"prefill-{label}", model, logdir, core=0, extra_env=pre_env,
                 kv_config=kv_config("kv_producer", pre_inner, port=port, **(pre_adapter or {})), tp=tp[0])
    dec = Server(f"decode-{label}", model, logdir, core=1,
                 kv_config=kv_config("kv_consumer", dec_inner, cls=dec_class, **dec_adapter), tp=tp[1])
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        for s in (pre, dec):
            if "compat hash" not in s.text():
                raise Failed(f"{s.name} did not log its negotiated layout and compat hash\n{s.tail()}")
        # A transport alone matches only decodes' requests, so prefill's scheduler answers its
        # own requests without a call to the worker process; a composite with a cache child
        # asks (joint pairs here hold lmcache: `pre_inner` None).
        local = "requests that are not decodes' match nothing, answered here" in pre.text()
        if local != ((pre_inner or {}).get("kv_connector") == "NixlConnector"):
            raise Failed(f"{label}: prefill's scheduler {'answers' if local else 'asks about'} requests that are not "
                         f"decodes' (expected: answered itself for a transport alone)\n{pre.tail()}")
        got = [tokens_of(pd_complete(pre.url, dec.url, p, f"pd-{label}-{i}")) for i, p in enumerate(ps)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise Failed(f"{label}: prompt {i} ({len(ps[i])} tokens): P/D gave {g}, monolithic {e}")
        # And it does so for each request (vLLM's stats trail by a step): every prefill request
        # answered without the worker process, or, for a composite with a cache, none.
        here = "vllm:kvconnect_matches_answered_here_total"
        answered = wait_metric(pre.url, here, len(ps), timeout=10 if local else 3)
        if (answered < len(ps)) if local else answered:
            raise Failed(f"{label}: prefill's scheduler answered {answered:.0f} matches of its {len(ps)} requests itself "
                         f"({here}); expected {'every one' if local else 'none'}")
        ext = external_tokens(dec.text())
        # Decode loads every prompt token but the last, also where that ends inside a block.
        want = [loadable(p) for p in ps if loadable(p)]
        if sorted(ext) != sorted(want):
            raise Failed(f"{label}: decode loaded external tokens {ext}, expected {want} (every prompt token but the last)\n{dec.tail()}")
        # Each of decode's TP ranks loads its own share of every request's KV.
        loaded = dec.text().count("loaded its external KV")
        if loaded != len(want) * tp[1] or "failed to load its external KV" in dec.text():
            raise Failed(f"{label}: decode's {tp[1]} worker(s) finished {loaded} loads for {len(want)} requests, or a load failed\n{dec.tail()}")
        # `load: sync`, and the default `auto` over shm for these small prompts, really took
        # vLLM's synchronous path: every load ended in its own step; async never did.
        # (`joint_dec`: decode's config in the deployment file of a jointly negotiated pair.)
        extra = (dec_inner or joint_dec or {}).get("kv_connector_extra_config", {})
        mode = extra.get("load", "auto")
        sync = mode == "sync" or (mode == "auto" and extra.get("backend", "shm") == "shm")
        synced = dec.text().count("loaded its external KV synchronously")
        if synced != (loaded if sync else 0):
            raise Failed(f"{label}: decode's load mode {mode!r} should have made {loaded if sync else 0} "
                         f"of {loaded} loads synchronous, but {synced} were\n{dec.tail()}")
        if pre_adapter and "deployment" in pre_adapter:
            hp, hd = compat_hash(pre.text()), compat_hash(dec.text())
            if (joint_peer_hash(pre.text()), joint_peer_hash(dec.text())) != (hd, hp):
                raise Failed(f"{label}: jointly negotiated, but each side's view of the other's compat hash "
                             f"differs from the other's own ({hp}, {hd})\n{pre.tail()}\n{dec.tail()}")
            print(f"ok: {label}: both servers negotiated jointly from {pre_adapter['deployment']}; "
                  f"prefill {hp[:12]}, decode {hd[:12]}, each as the other predicted")
        if "handshake accepted" not in dec.text():
            raise Failed(f"{label}: decode never handshook with prefill\n{dec.tail()}")
        # kvconnect's counters reach vLLM's /metrics through the connector stats hooks.
        n, total = len(want), sum(want)
        loads = wait_metric(dec.url, "vllm:kvconnect_loads_done_total", n)
        from_peer = wait_metric(dec.url, "vllm:kvconnect_loads_by_source_total", n, 'source="peer"')
        ext_m = wait_metric(dec.url, "vllm:kvconnect_external_tokens_total", total)
        vllm_ext = wait_metric(dec.url, "vllm:external_prefix_cache_hits_total", total)
        # Prefill holds every request's blocks for decode, loaded or not (decode computes a
        # prompt shorter than a block itself and releases it).
        sends = wait_metric(pre.url, "vllm:kvconnect_sends_done_total", len(ps))
        expired = metric(pre.url, "vllm:kvconnect_sends_expired_total")
        if (loads, from_peer, ext_m, vllm_ext, sends, expired) != (n, n, total, total, len(ps), 0):
            raise Failed(f"{label}: /metrics show decode loads {loads} ({from_peer} from a peer), kvconnect external "
                         f"tokens {ext_m}, vLLM external prefix-cache hits {vllm_ext}, prefill sends {sends} "
                         f"({expired} ended by the lease); expected {n} ({n}), {total}, {total}, {len(ps)} (0)")
        if not wait_log(dec, "KV Transfer metrics: kvconnect_"):
            raise Failed(f"{label}: vLLM's stats log never showed kvconnect's transfer metrics\n{dec.tail()}")
        if lure:
            check_unlisted_producer(pre, dec, label, prompts(9, [200])[0])
            line = next((l for l in dec.text().splitlines() if "side_channel_port ignored" in l), "")
            if "WARN" not in line or "a decode serves no side channel" not in line:
                raise Failed(f"{label}: decode given side_channel_port did not warn that it ignores it: {line!r}\n{dec.tail()}")
            print(f"ok: {label}: decode warned about its side_channel_port: {line.strip()[:300]}")
        if via_proxy:
            check_kvconnect_proxy(pre, dec, label, *via_proxy)
        if idle:
            check_after_idle(pre, dec, label, pre_inner, *idle)
        if load:
            from test_load import check_under_load
            check_under_load(pre, dec, load[0], load[1], pre_inner["kv_connector_extra_config"]["backend"], load[2])
        segments = check_shared_kv(pre, label, shm)
    check_segments_removed(segments, label)
    print(f"ok: P/D over {label} equals monolithic for {len(ps)} prompts; decode loaded {sum(ext)} prompt tokens"
          + (f"; prefill's KV cache was {len(segments)} shared-memory segments, removed at exit" if shm else ""))


def check_after_idle(pre: Server, dec: Server, label: str, pre_inner: dict, prompt: list[int], expected: list):
    """The first request after a lull longer than prefill's idle_timeout (which closes the link
    decode keeps to it) still loads its KV: the closed link is noticed or retried, never a
    failed load that decode recomputes."""
    idle_s = float(pre_inner["kv_connector_extra_config"]["idle_timeout"])
    failed0 = dec.text().count("failed to load its external KV")
    ext0 = len(external_tokens(dec.text()))
    time.sleep(idle_s * 2.5)
    # The link decode keeps has been closed by now (perhaps already before the lull, whose
    # requests also left it idle past the timeout).
    if "closing an idle connection" not in pre.text():
        raise Failed(f"{label}: prefill never closed an idle connection (idle_timeout {idle_s} s)\n{pre.tail()}")
    got = tokens_of(pd_complete(pre.url, dec.url, prompt, f"idle-{label}"))
    if got != expected:
        raise Failed(f"{label}: after {idle_s * 2.5:.1f} s idle, P/D gave {got}, monolithic {expected}")
    ext = external_tokens(dec.text())[ext0:]
    if ext != [loadable(prompt)] or dec.text().count("failed to load its external KV") != failed0:
        raise Failed(f"{label}: after {idle_s * 2.5:.1f} s idle (prefill's idle_timeout {idle_s} s) decode loaded "
                     f"{ext}, expected [{loadable(prompt)}] and no failed load\n{dec.tail()}")
    print(f"ok: {label}: after {idle_s * 2.5:.1f} s idle, past prefill's idle_timeout of {idle_s} s, the next "
          f"request loaded its {loadable(prompt)} tokens and equals monolithic")


def check_shared_kv(pre: Server, label: str, shm: bool) -> list[str]:
    """Prefill's KV cache is in shared memory exactly when `shm`, allocated and mapped whole
    (`check_kv_mapped_whole`); returns its segments."""
    segments = shared_kv_segments(pre.text())
    if shm != bool(segments):
        raise Failed(f"{label}: prefill's KV cache in shared memory: {segments or 'no'}, expected {shm}\n{pre.tail()}")
    if segments:
        check_kv_mapped_whole(pre, label, segments)
    return segments


def check_segments_removed(segments: list[str], label: str):
    """The segments go with the server that made them (its resource tracker unlinks them once
    its processes are gone, a moment after the server itself)."""
    deadline = time.time() + 20
    while True:
        left = [s for s in segments if Path("/dev/shm", s.lstrip("/")).exists()]
        if not left or time.time() > deadline:
            break
        time.sleep(0.5)
    if left:
        raise Failed(f"{label}: prefill's shared-memory segments outlived it: {left}")


def check_kv_mapped_whole(pre: Server, label: str, segments: list[str]):
    """Prefill's KV cache in shared memory is allocated and mapped from the start, as vLLM's
    own `torch.zeros` would have it: every page of the worker's mappings of its segments is
    resident (/proc/PID/smaps: Rss equal to Size, summed over a mapping's pieces), though
    these prompts wrote only a few blocks of the 1 GiB cache. Left to fault in, each fresh
    block cost vLLM a page fault per 4 KiB (about 110 per 410-token prompt) inside the step
    that computes it."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pre.proc.pid:
                continue
            lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
        except (OSError, ProcessLookupError):
            continue
        name = None
        for line in lines:
            head = line.split()
            if head and not head[0].endswith(":"):  # a mapping's first line; anonymous ones name no file
                path = head[5] if len(head) > 5 else ""
                name = "/" + path[len("/dev/shm/"):] if path.startswith("/dev/shm/") else None
                name = name if name in segments else None
            elif name and head[0] in ("Size:", "Rss:"):
                kb = found.setdefault((pid, name), {})
                kb[head[0].rstrip(":")] = kb.get(head[0].rstrip(":"), 0) + int(head[1])
    mapped = {n for _, n in found}
    if mapped != set(segments):
        raise Failed(f"{label}: prefill's processes map the KV segments {sorted(mapped)}, expected {segments}")
    partial = {k: v for k, v in found.items() if not v.get("Size") or v.get("Rss") != v["Size"]}
    if partial:
        raise Failed(f"{label}: prefill's KV cache in shared memory is not allocated and mapped at startup "
                     f"(pid, segment: kB): {partial}")


def shared_kv_segments(log: str) -> list[str]:
    """The shared-memory segments the adapter logged vLLM's KV cache was put in."""
    for line in log.splitlines():
        if "kvconnect: vLLM's KV cache (" in line and ") is in shared memory: " in line:
            return [s.strip() for s in line.split(") is in shared memory: ")[1].split(",")]
    return []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="shm,tcp",
                    help="nixl backends, each with -sync or -async for decode's load mode (default auto: "
                         "synchronous over shm for these prompts): shm, shm-async, tcp-sync, ...")
    ap.add_argument("--parts", default="pd,load,composite,refused",
                    help="which checks: pd (each backend against monolithic), load (tests/vllm/test_load.py's "
                         "workload through the pd part's pairs whose decode loads in the default mode, after their "
                         "other checks), composite, refused (bad configs)")
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    if not parts or parts - {"pd", "load", "composite", "refused"}:
        ap.error(f"--parts {a.parts!r}: give pd, load, composite and/or refused, comma-separated")
    if "load" in parts and "pd" not in parts:
        ap.error("--parts load runs on the pd part's pairs: give pd too")

    def checks(model: str, tmp: Path):
        if parts & {"pd", "composite"}:
            pd_checks(model, tmp)
        if "refused" in parts:
            refused_checks(model, tmp)

    def pd_checks(model: str, tmp: Path):
        ps, pp, pf = prompts(), prompts(8, PROXY_PROMPT_LENS), prompts(12, PROXY_PROMPT_LENS + [70, 40, 50])
        # A fresh prompt for the request after a lull (decode's prefix cache holds the others).
        idle_prompt = prompts(11, [150])[0]
        # test_load's workload, sent through the pairs below after their own checks: one
        # monolithic server computes its outputs too (as test_load's own would, 8 in flight).
        from test_load import IN_FLIGHT, REQUESTS, workload
        load_ps = workload(REQUESTS) if "load" in parts else []
        out, load_expected = run_monolithic(model, tmp, ps + pp + pf + [idle_prompt], under_load=(load_ps, IN_FLIGHT))
        expected, expected_idle = out[:len(ps)], out[-1]
        expected_pp, expected_pf = out[len(ps):len(ps) + len(pp)], out[len(ps) + len(pp):-1]
        print(f"monolithic: {len(expected)} greedy outputs of {MAX_TOKENS} tokens"
              + (f", and {len(load_ps)} more, {IN_FLIGHT} in flight" if load_ps else ""))
        proxied = False
        loaded = set()
        for spec in a.backends.split(",") if "pd" in parts else []:
            # `shm-async`, `tcp-sync`: decode's load mode; without one, `auto` (synchronous
            # over shm, inside the step that computes the prompt's last token).
            backend, _, mode = spec.partition("-")
            # Prefill closes links idle for 1 s, and a request comes after a longer lull: over
            # tcp the blocks travel on those links, over shm the `done` that ends each load.
            pre, dec = nixl(backend), nixl(backend)
            if mode:
                dec["kv_connector_extra_config"]["load"] = mode
            pre["kv_connector_extra_config"]["idle_timeout"] = 1
            # The `kvconnect proxy` binary goes in front of the first shm pair, whatever its load.
            proxy = backend == "shm" and not proxied
            proxied |= proxy
            # test_load's workload goes through the first pair of each backend whose decode
            # loads in the default mode (`auto`), as test_load's own pairs do.
            load = load_ps and not mode and backend not in loaded
            if load:
                loaded.add(backend)
            run_pd(model, tmp, ps, f"nixl-{spec}", pre, dec, expected,
                   shm=backend == "shm", lure=backend == "tcp", via_proxy=(pp, expected_pp, pf, expected_pf) if proxy else None,
                   idle=(idle_prompt, expected_idle), load=(load_ps, load_expected, IN_FLIGHT) if load else None)
        if "composite" not in parts:
            return
        composite = {"kv_connector": "PdConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {"chunk_size": BLOCK}},
            nixl("tcp")]}}
        # The composite on prefill, a plain transport on decode, each negotiating alone; decode
        # through the HMA-capable class, so vLLM keeps its hybrid KV cache manager on there and
        # off on prefill (lmcache lacks it). On a model with one attention kind the KV cache
        # groups agree anyway, so the handshake accepts the pair.
        run_pd(model, tmp, ps, "composite", composite, nixl("tcp"), expected, dec_class="KvconnectHmaConnector")
        # The same pair negotiated jointly: both servers read one deployment file and each
        # computes both roles' layouts, so each knows the other's compat hash before any
        # request.
        decode_in_file = nixl("tcp")
        dep = write_deployment(tmp / "composite.toml", model, composite, decode_in_file)
        run_pd(model, tmp, ps, "composite-joint", None, None, expected, joint_dec=decode_in_file,
               pre_adapter={"deployment": str(dep)}, dec_adapter={"deployment": str(dep)})

    def refused_checks(model: str, tmp: Path):
        # A misspelled name, through a server's start and exit: every known name, and the
        # closest one.
        run_refused(model, tmp, "misspelled-connector", {"kv_connector": "NixlConector"},
                    "no connector named 'NixlConector' (did you mean 'NixlConnector'?): known connectors are nixl, ")
        # A deployment file that says otherwise than vLLM runs is refused, naming the setting.
        bad = write_deployment(tmp / "block16.toml", model, nixl("tcp"), nixl("tcp"))
        bad.write_text(bad.read_text().replace("[decode]\n", "[decode]\nblock_size = 16\n"))
        run_refused_in_process(model, [
            ("hma-class-over-lmcache",
             kv_config("kv_both", {"kv_connector": "LMCacheConnectorV1"}, port=free_port(), cls="KvconnectHmaConnector"),
             "name KvconnectConnector instead of KvconnectHmaConnector"),
            # vLLM reads kv_load_failure_policy only at the top level of --kv-transfer-config.
            ("failure-policy-inside-kvconnect",
             kv_config("kv_both", dict(nixl("tcp"), kv_load_failure_policy="recompute"), port=free_port()),
             "kv_load_failure_policy is set in kv_connector_extra_config.kvconnect, where it has no effect"),
            ("deployment-disagrees", kv_config("kv_consumer", None, deployment=str(bad)),
             "block_size = 16 in the file, 32 in this vLLM server"),
        ])
        # The same check fails for a config vLLM starts with.
        try:
            run_refused_in_process(model, [("accepted", kv_config("kv_producer", nixl("tcp"), port=free_port()),
                                            "kvconnect:")])
        except Failed as e:
            if "vLLM made its config and kvconnect's connector" not in str(e):
                raise
        else:
            raise Failed("run_refused_in_process passed a config that vLLM and kvconnect accept")
        print("ok: the in-process refusal check fails for a config that vLLM and kvconnect accept")

    run_checks("pd", a.keep, checks)


if __name__ == "__main__":
    main()

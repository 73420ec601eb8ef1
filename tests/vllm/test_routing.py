"""`kvconnect proxy --routing kv` in front of real vLLM servers, routing by vLLM's own KV
events.

Two prefill servers (KvconnectConnector over nixl tcp) publish their prefix caches' events
with vLLM's `--kv-events-config` (zmq, with a replay endpoint) and report cached prompt tokens
(`--enable-prompt-tokens-details`); one decode server; `kvconnect proxy --routing kv` follows
both publishers. Prompts are text and chat messages, which vLLM tokenizes: the proxy asks a
prefill server's `/tokenize` for their ids. Checked:

- after a document's first request, every later request that starts with that document goes
  to the prefill server that computed it (round-robin would send half of them elsewhere), and
  that server reports the prefix as cached;
- the router's predicted hit tokens equal what the servers report, request by request;
- a chat completion's rendered prompt is routed the same way (the chat template applied by
  the server's own `/tokenize`);
- the same prompt gives the same output whichever way it went;
- decode loads every request's KV from the prefill server it went to (none recomputed), also
  after a lull past prefill's idle_timeout (1 s) and the proxy's pooled connections' idle
  limit (4 s), and the request after the lull is still routed by the index;
- a prefill server killed with SIGKILL: the next request that its cache would have drawn is
  served by the other one, with no error to the client; within seconds the proxy's watch of
  its servers' `/health` marks it down (its /health says so) and no later request tries it.

    VENV/bin/python tests/vllm/test_routing.py [--keep]

Exit status 0 when every check passed.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, Failed, Server, external_tokens, free_port, kv_config, metric, run_checks, serving,
)
from test_pd import kvconnect_bin, nixl  # noqa: E402

# Words for the documents (any text: the tiny model's tokenizer is byte-level BPE).
WORDS = ("river stone lantern copper meadow signal harbor violet engine quiet marble forest "
         "orbit candle thunder silver garden mirror falcon summit").split()
DOCS = 3
ROUNDS = 3


def document(i: int, words: int = 20) -> str:
    """Document `i`: a few hundred tokens, several of vLLM's blocks, unlike the others'."""
    return " ".join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] + str((i * 31 + j) % 97) for j in range(words))


def ask(proxy: str, label: str, prompt: str = None, messages=None) -> dict:
    """One non-streamed request through the proxy (a completion of `prompt`, or a chat
    completion of `messages`): its prefill server's address and its text."""
    path, body = "/v1/completions", {"model": "tiny", "prompt": prompt}
    if messages is not None:
        path, body = "/v1/chat/completions", {"model": "tiny", "messages": messages}
    body.update(max_tokens=4, temperature=0.0, ignore_eos=True)
    r = requests.post(proxy + path, json=body, timeout=120)
    if r.status_code != 200:
        raise Failed(f"{label}: HTTP {r.status_code} through the proxy: {r.text[:400]}")
    v = r.json()
    choice = v["choices"][0]
    text = choice.get("text") if messages is None else choice["message"]["content"]
    return {"prefill": v["kvconnect"]["proxy"]["prefill_worker"], "text": text}


def router_figures(proxy: str) -> tuple[float, float, float]:
    """(decisions by the index, predicted hit tokens, actual hit tokens)."""
    return (metric(proxy, "kvconnect_router_decisions_total", 'by="kv"'),
            metric(proxy, "kvconnect_router_predicted_hit_tokens_total"),
            metric(proxy, "kvconnect_router_actual_hit_tokens_total"))


def wait_applied(proxy: str, more_than: float, label: str) -> float:
    """Waits until the proxy has applied more event batches than `more_than`."""
    deadline = time.time() + 30
    while time.time() < deadline:
        n = metric(proxy, "kvconnect_router_event_batches_applied_total")
        if n > more_than:
            return n
        time.sleep(0.2)
    raise Failed(f"{label}: the proxy applied no KV event batch from vLLM's publishers within 30 s")


def idle_closing() -> dict:
    """nixl over tcp, prefill closing links idle for 1 s."""
    inner = nixl("tcp")
    inner["kv_connector_extra_config"]["idle_timeout"] = 1
    return inner


def check_routing(model: str, logdir: Path):
    events = [(free_port(), free_port()) for _ in range(2)]
    pres = [Server(f"prefill-{i}", model, logdir, core=i, kv_config=kv_config("kv_producer", idle_closing(), port=free_port()),
                   args=["--enable-prompt-tokens-details", "--kv-events-config", json.dumps({
                       "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                       "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"})])
            for i, (pub, replay) in enumerate(events)]
    dec = Server("decode", model, logdir, core=1, kv_config=kv_config("kv_consumer", nixl("tcp")))
    with serving(*pres, dec):
        for s in (*pres, dec):
            s.wait_healthy()
        flags = ["--routing", "kv", "--kv-block-size", str(BLOCK)]
        for pub, replay in events:
            flags += ["--kv-events", f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"]
        cmd = [str(kvconnect_bin()), "proxy", "--listen", "127.0.0.1:0", "--decode", dec.url]
        for s in pres:
            cmd += ["--prefill", s.url]
        proxy_log = open(logdir / "proxy.log", "w")
        proc = subprocess.Popen(cmd + flags, stdout=subprocess.PIPE, stderr=proxy_log, text=True)
        try:
            first = proc.stdout.readline()
            if not first:
                raise Failed(f"kvconnect proxy did not start: {(logdir / 'proxy.log').read_text()[:500]}")
            run_routing_checks(json.loads(first)["proxy"], pres, dec, logdir / "proxy.log")
        finally:
            proc.terminate()
            proc.wait(10)
            proxy_log.close()


def loads(dec: Server) -> int:
    """Loads decode finished; a failed one fails the check."""
    text = dec.text()
    if "failed to load its external KV" in text:
        raise Failed(f"decode failed to load a request's KV\n{dec.tail()}")
    return text.count("loaded its external KV")


def routed(proxy: str, label: str, holder: str, **prompt) -> dict:
    """One request that the index must send to `holder`, its prediction equal to what the
    server reports."""
    before = router_figures(proxy)
    a = ask(proxy, label, **prompt)
    after = router_figures(proxy)
    if a["prefill"] != holder:
        raise Failed(f"{label}: routed to {a['prefill']}, but {holder} holds its prefix (router: {after})")
    predicted, hit = after[1] - before[1], after[2] - before[2]
    if after[0] != before[0] + 1 or predicted < 2 * BLOCK or predicted != hit:
        raise Failed(f"{label}: the index decided {after[0] - before[0]:.0f} time(s), predicted {predicted:.0f} "
                     f"cached tokens, the server reported {hit:.0f}")
    return dict(a, predicted=predicted)


def run_routing_checks(proxy: str, pres: list, dec: Server, log: Path):
    addr = {s.url.removeprefix("http://"): s for s in pres}
    applied = 0.0
    # Round 0: each document's first request, wherever it goes; its blocks' events follow.
    holder, answers = {}, {}
    for d in range(DOCS):
        a = ask(proxy, f"doc {d} first", prompt=document(d) + " question zero")
        holder[d], answers[(d, 0)] = a["prefill"], a["text"]
        applied = wait_applied(proxy, applied, f"doc {d}")
    # Later rounds: each document's requests back to back (round-robin would alternate).
    for r in range(1, ROUNDS):
        for d in range(DOCS):
            cached0 = metric(f"http://{holder[d]}", "vllm:prefix_cache_hits_total")
            a = routed(proxy, f"doc {d} round {r}", holder[d], prompt=document(d) + f" question {r}")
            cached = metric(f"http://{holder[d]}", "vllm:prefix_cache_hits_total") - cached0
            if cached < a["predicted"]:
                raise Failed(f"doc {d} round {r}: vLLM's prefix cache hit {cached:.0f} tokens, "
                             f"the router predicted {a['predicted']:.0f}")
            answers[(d, r)] = a["text"]
    # Each distinct prompt's decode loaded its KV from prefill: none was recomputed.
    if loads(dec) != DOCS * ROUNDS:
        raise Failed(f"decode finished {loads(dec)} loads for {DOCS * ROUNDS} requests\n{dec.tail()}")
    servers = sorted(set(holder.values()))
    print(f"ok: {DOCS * (ROUNDS - 1)} text prompts each routed to the prefill server holding their document "
          f"(documents on {len(servers)} server(s)), every prediction equal to vLLM's cached tokens "
          f"({router_figures(proxy)[1]:.0f} tokens)")
    # The same prompt again: the same output, from the holder.
    again = ask(proxy, "repeat", prompt=document(0) + " question zero")
    if again["text"] != answers[(0, 0)] or again["prefill"] != holder[0]:
        raise Failed(f"a repeated prompt gave {again}, first {answers[(0, 0)]!r} from {holder[0]}")
    # Chat: the server's template renders the messages; /tokenize gives those ids.
    chat = [{"role": "user", "content": document(DOCS + 1, 18) + " first"}]
    applied = metric(proxy, "kvconnect_router_event_batches_applied_total")
    c0 = ask(proxy, "chat first", messages=chat)
    wait_applied(proxy, applied, "chat")
    c1 = routed(proxy, "chat second", c0["prefill"],
                messages=[{"role": "user", "content": chat[0]["content"][:-6] + " second"}])
    print(f"ok: a chat completion routed to the server holding its rendered prefix "
          f"({c1['predicted']:.0f} tokens predicted and reported)")
    # A lull past prefill's idle_timeout and the proxy's pool idle limit: still routed by the
    # index, and decode still loads the KV.
    loaded0 = loads(dec)
    time.sleep(5)
    routed(proxy, "after a lull", holder[1], prompt=document(1) + " question after a lull")
    deadline = time.time() + 10
    while loads(dec) == loaded0 and time.time() < deadline:
        time.sleep(0.2)
    if loads(dec) != loaded0 + 1:
        raise Failed(f"after a 5 s lull: decode finished {loads(dec) - loaded0} loads for 1 request\n{dec.tail()}")
    print(f"ok: after a 5 s lull a request was routed to the holder of its prefix and decode loaded its KV "
          f"({external_tokens(dec.text())[-1]} tokens); {loaded0 + 1} loads in all, none failed")
    rr = metric(proxy, "kvconnect_router_decisions_total", 'by="round_robin"')
    # Kill -9 the server holding a document: the proxy skips it and the request is served.
    victim_addr = holder[0]
    victim = addr[victim_addr]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(30)
    a = ask(proxy, "after kill", prompt=document(0) + " question after")
    if a["prefill"] == victim_addr:
        raise Failed(f"after the kill: served by the dead server {victim_addr}?")
    print(f"ok: with {victim.name} killed (SIGKILL), a prompt its cache held was served by {a['prefill']}; "
          f"{rr:.0f} round-robin decision(s) before events arrived")
    # The proxy's own watch of its servers' /health marks the dead one down within seconds:
    # from then on no request tries it first.
    why = wait_down(proxy, victim_addr)
    tried0 = log.read_text().count("worker unreachable")
    b = ask(proxy, "after it was marked down", prompt=document(0) + " question once marked down")
    if b["prefill"] == victim_addr or log.read_text().count("worker unreachable") != tried0:
        raise Failed(f"once marked down ({why}), {victim_addr} was still tried: served by {b['prefill']}\n"
                     f"{log.read_text()[-1500:]}")
    print(f"ok: the proxy marked {victim_addr} down ({why[:160]}); the next request went to {b['prefill']} "
          f"without trying it")


def wait_down(proxy: str, http: str, timeout: float = 15) -> str:
    """Waits until the proxy's /health reports the server at `http` down; returns why."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = requests.get(proxy + "/health", timeout=10)
        down = next((w.get("down") for w in r.json().get("workers", []) if w.get("http") == http), None)
        if down:
            if r.status_code != 503:
                raise Failed(f"the proxy reports {http} down ({down}) but answers /health with {r.status_code}")
            return down
        time.sleep(0.5)
    raise Failed(f"the proxy did not mark the killed server {http} down within {timeout:.0f} s: {r.text[:500]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    a = ap.parse_args()
    run_checks("routing", a.keep, check_routing)


if __name__ == "__main__":
    main()

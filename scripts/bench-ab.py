#!/usr/bin/env python3
"""Compares two kvconnect builds on one KV transfer, transfer by transfer.

    scripts/bench-ab.py BEFORE_BIN AFTER_BIN [--pairs 31] [--tokens 8192] [--backends shm,tcp]

For each backend it starts, side by side, a prefill and a decode worker of each build (the
transfer-only engine with synthetic KV of Qwen3-0.6B's geometry, a plain NixlConnector, the
same data-plane secret), makes one warm-up transfer on each pair (which pays the handshakes),
then PAIRS pairs of transfers, one on each build, back to back, the build that goes first
alternating pair by pair: both sides of a pair see the machine within a fraction of a second
of each other. A transfer's time is decode's own (`transfer_us`: start_load_kv to the load
reported finished), and only counts when decode verified every block it received. It prints
every pair, then per backend the median and quartiles of after/before transfer time (1.02
means the after build takes 2% longer), with the machine's cores and load average before and
after.
"""

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

MODEL = "fixtures/models/Qwen--Qwen3-0.6B/config.json"


class Worker:
    """A `kvconnect worker` process; its HTTP address from the line it prints."""

    def __init__(self, binary, role, backend, engine, blocks, env):
        config = json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": {"backend": backend}}
        )
        args = [binary, "worker", "--kv-transfer-config", config, "--model", MODEL, "--engine-id", engine,
                "--synthetic-kv", "--num-blocks", str(blocks)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        line = ""
        deadline = time.time() + 180
        while not line.startswith("{"):
            line = self.proc.stdout.readline()
            if not line or time.time() > deadline:
                self.stop()
                sys.exit(f"{binary} worker {engine} did not start")
        self.http = json.loads(line)["http"]
        # Keep reading so the worker never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def post(self, body):
        req = urllib.request.Request(
            f"http://{self.http}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def transfer(prefill, decode, prompt):
    """One prompt's KV from prefill to decode; decode's transfer time in seconds."""
    p = prefill.post({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    d = decode.post({"request_id": p["id"], "prompt": prompt, "max_tokens": 1,
                     "kv_transfer_params": p["kv_transfer_params"]})
    params = d.get("kv_transfer_params") or {}
    if params.get("verified") is not True:
        sys.exit(f"decode did not verify the transferred KV: {d}")
    return params["transfer_us"] / 1e6


def quartiles(xs):
    q = statistics.quantiles(sorted(xs), n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def load():
    return os.getloadavg()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--pairs", type=int, default=31)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--backends", default="shm,tcp")
    a = ap.parse_args()
    env = dict(os.environ)
    env.setdefault("KVCONNECT_SIDE_CHANNEL_TOKEN", secrets.token_hex(32))
    env["RUST_LOG"] = "warn"
    blocks = a.tokens // 16 + 8
    prompt = [0] * a.tokens
    print(f"cores {os.cpu_count()}; load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for backend in a.backends.split(","):
        builds = {}
        try:
            for name, binary in (("before", a.before), ("after", a.after)):
                builds[name] = (Worker(binary, "kv_producer", backend, f"{name}-prefill", blocks, env),
                                Worker(binary, "kv_consumer", backend, f"{name}-decode", blocks, env))
            for name in builds:
                transfer(*builds[name], prompt)  # warm-up: handshakes, page faults
            load_before = load()
            ratios, times = [], {"before": [], "after": []}
            for i in range(a.pairs):
                order = ("before", "after") if i % 2 == 0 else ("after", "before")
                t = {name: transfer(*builds[name], prompt) for name in order}
                for name in t:
                    times[name].append(t[name])
                ratios.append(t["after"] / t["before"])
                print(f"{backend} pair {i + 1}: before {t['before'] * 1e3:.1f} ms, after {t['after'] * 1e3:.1f} ms, "
                      f"ratio {ratios[-1]:.4f} (load {load():.2f})", flush=True)
            q1, med, q3 = quartiles(ratios)
            tb, ta = statistics.median(times["before"]), statistics.median(times["after"])
            print(f"{backend}: after/before median {med:.4f}, quartiles {q1:.4f} .. {q3:.4f}, {len(ratios)} pairs; "
                  f"median transfer before {tb * 1e3:.1f} ms, after {ta * 1e3:.1f} ms; "
                  f"load average {load_before:.2f} -> {load():.2f}", flush=True)
        finally:
            for pair in builds.values():
                for w in pair:
                    w.stop()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

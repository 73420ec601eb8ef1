"""kvconnect inside a real vLLM (CPU): prefill/decode through KvconnectConnector equals a
monolithic server, token for token, and decode loads the prompt's KV instead of computing it.

    VENV/bin/python tests/vllm/test_pd.py [--backends tcp,shm] [--keep]

Runs with the venv scripts/install-vllm.sh makes, with kvconnect installed into it
(`VENV/bin/pip install ./python`). Servers run one or two at a time (about 4 GB each).
Exit status 0 when every check passed; the failing check and the servers' log tails otherwise.
"""

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import requests
    import vllm  # noqa: F401
    import kvconnect.vllm  # noqa: F401
except ImportError as e:
    msg = (f"vLLM tests skipped: {e}; install vLLM with scripts/install-vllm.sh and kvconnect with "
           "VENV/bin/pip install ./python, then run this with VENV/bin/python")
    if os.environ.get("KVCONNECT_REQUIRE_VLLM") == "1":
        sys.exit("FAILED: " + msg)
    print(msg)
    sys.exit(0)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_tiny_model  # noqa: E402

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
# Shorter than a block, exactly one, one past, several, and long.
PROMPT_LENS = [5, 20, 31, 32, 33, 63, 64, 65, 96, 100, 150, 200]
MAX_TOKENS = 12
START_TIMEOUT = 420


class Failed(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in PROMPT_LENS]


class Server:
    def __init__(self, name: str, model: str, logdir: Path, core: int, kv_config=None, extra_env=None):
        self.name = name
        self.port = free_port()
        self.log_path = logdir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK),
            "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
        ]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        env = dict(os.environ)
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                    "KVCONNECT_LOG": "info", "PYTHONFAULTHANDLER": "1"})
        env.update(extra_env or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout=START_TIMEOUT):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise Failed(f"{self.name} exited with status {self.proc.returncode} before it was healthy\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise Failed(f"{self.name} not healthy within {timeout} s\n{self.tail()}")

    def wait_exit(self, timeout) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise Failed(f"{self.name} still running after {timeout} s\n{self.tail()}")

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, n=40) -> str:
        lines = self.text().splitlines()[-n:]
        return "\n".join(f"  [{self.name}] {l}" for l in lines)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def complete(url: str, prompt: list[int], request_id: str, kv_transfer_params=None, max_tokens=MAX_TOKENS) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    r = requests.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=120)
    if r.status_code != 200:
        raise Failed(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def tokens_of(resp: dict) -> list:
    c = resp["choices"][0]
    return c.get("token_ids") or c["text"]


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


def kv_config(role: str, inner: dict, port=None) -> dict:
    extra = {"kvconnect": inner}
    if port is not None:
        extra["side_channel_port"] = port
    return {"kv_connector": "KvconnectConnector", "kv_connector_module_path": "kvconnect.vllm",
            "kv_role": role, "kv_connector_extra_config": extra}


def external_tokens(log: str) -> list[int]:
    out = []
    for line in log.splitlines():
        if "kvconnect scheduler: request" in line and "external tokens" in line:
            out.append(int(line.split(" loads ")[1].split()[0]))
    return out


def run_monolithic(model: str, logdir: Path, ps) -> list:
    srv = Server("monolithic", model, logdir, core=0)
    try:
        srv.wait_healthy()
        return [tokens_of(complete(srv.url, p, f"mono-{i}")) for i, p in enumerate(ps)]
    finally:
        srv.stop()


def run_pd(model: str, logdir: Path, ps, backend: str, expected: list):
    inner = {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backend": backend}}
    pre = Server(f"prefill-{backend}", model, logdir, core=0,
                 kv_config=kv_config("kv_producer", inner, port=free_port()))
    dec = Server(f"decode-{backend}", model, logdir, core=1, kv_config=kv_config("kv_consumer", inner))
    try:
        pre.wait_healthy()
        dec.wait_healthy()
        for s in (pre, dec):
            if "compat hash" not in s.text():
                raise Failed(f"{s.name} did not log its negotiated layout and compat hash\n{s.tail()}")
        got = [tokens_of(pd_complete(pre.url, dec.url, p, f"pd-{backend}-{i}")) for i, p in enumerate(ps)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise Failed(f"{backend}: prompt {i} ({len(ps[i])} tokens): P/D gave {g}, monolithic {e}")
        ext = external_tokens(dec.text())
        # vLLM's CPU attention continues a prompt from a block boundary only: decode loads the
        # whole blocks before the prompt's last token and computes the rest.
        want = [(len(p) - 1) // BLOCK * BLOCK for p in ps if len(p) > BLOCK]
        if sorted(ext) != sorted(want):
            raise Failed(f"{backend}: decode loaded external tokens {ext}, expected {want} (the whole blocks before each prompt's last token)\n{dec.tail()}")
        loaded = dec.text().count("loaded its external KV")
        if loaded != len(want) or "failed to load its external KV" in dec.text():
            raise Failed(f"{backend}: decode's worker finished {loaded} loads for {len(want)} requests, or a load failed\n{dec.tail()}")
        if "handshake accepted" not in dec.text():
            raise Failed(f"{backend}: decode never handshook with prefill\n{dec.tail()}")
        print(f"ok: P/D over nixl/{backend} equals monolithic for {len(ps)} prompts; decode loaded {sum(ext)} prompt tokens")
    except Failed:
        print(pre.tail(), file=sys.stderr)
        print(dec.tail(), file=sys.stderr)
        raise
    finally:
        pre.stop()
        dec.stop()


def run_refused(model: str, logdir: Path, name: str, inner: dict, want: str):
    """vLLM must stop at startup with kvconnect's one-line message containing `want`."""
    srv = Server(name, model, logdir, core=0, kv_config=kv_config("kv_both", inner, port=free_port()))
    try:
        status = srv.wait_exit(START_TIMEOUT)
        text = srv.text()
        if status == 0:
            raise Failed(f"{name}: vLLM started")
        line = next((l for l in text.splitlines() if want in l and "KvconnectError" in l), None)
        if line is None:
            raise Failed(f"{name}: not refused with kvconnect's message ({want!r})\n{srv.tail()}")
        print(f"ok: {name} refused at startup: {line.strip()[:400]}")
    finally:
        srv.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="tcp")
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvconnect-vllm-"))
    model = str(tmp / "model")
    make_tiny_model.build(model)
    ps = prompts()
    try:
        expected = run_monolithic(model, tmp, ps)
        print(f"monolithic: {len(expected)} greedy outputs of {MAX_TOKENS} tokens")
        for backend in a.backends.split(","):
            run_pd(model, tmp, ps, backend, expected)
        run_refused(model, tmp, "unknown-connector", {"kv_connector": "NoSuchConnector"},
                    "no connector named 'NoSuchConnector'")
        run_refused(model, tmp, "shm-backend", {"kv_connector": "NixlConnector",
                    "kv_connector_extra_config": {"backend": "shm"}}, "not implemented: the nixl backend 'shm'")
        # flexkv works in NHD and would transpose into vLLM's CPU blocks, which are opaque.
        run_refused(model, tmp, "adapter-over-opaque", {"kv_connector": "FlexKVConnectorV1"},
                    "the engine's KV blocks are opaque")
    except Failed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        print(f"logs in {tmp}", file=sys.stderr)
        sys.exit(1)
    if not a.keep:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    print("all vLLM checks passed")


if __name__ == "__main__":
    main()

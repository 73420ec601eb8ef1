"""What the real-vLLM tests share: the import guard (skip, or fail under
KVCONNECT_REQUIRE_VLLM=1), a vLLM OpenAI server in its own process group, completions, the
adapter's kv-transfer-config and what its log and /metrics say.
"""

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
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
MAX_TOKENS = 12
START_TIMEOUT = 420

# The program a server runs: what `python -m vllm.entrypoints.openai.api_server` runs (vLLM's
# OpenAI API server, entry.main), from the command line rather than from that module. vLLM
# starts its engine core and each worker with multiprocessing's `spawn`, which imports the
# parent's main module in every child: run as `-m`, that is the api_server module and the
# whole API server behind it (FastAPI, the OpenAI protocol, tokenizers), which neither child
# uses; from `-c` there is no main module to import.
SERVE = "from vllm.entrypoints.launchers.api_server.entry import main; main()"


class Failed(Exception):
    pass


# Every server this script started: (name, seconds to healthy or None, seconds to stop or None).
# Printed as one summary line when the script exits, so that a CI log shows where each
# script's time went (vLLM's start is most of it).
_timings: dict = {}


def _secs(t) -> str:
    return "-" if t is None else f"{t:.0f}"


@atexit.register
def _print_timings() -> None:
    if not _timings:
        return
    starts = [t[0] for t in _timings.values() if t[0] is not None]
    stops = [t[1] for t in _timings.values() if t[1] is not None]
    each = ", ".join(f"{n} {_secs(t[0])}/{_secs(t[1])}" for n, t in _timings.items())
    print(f"servers: {len(_timings)} started, {len(starts)} healthy in {sum(starts):.0f} s "
          f"(mean {sum(starts) / max(1, len(starts)):.1f} s), stopped in {sum(stops):.0f} s; "
          f"each, healthy/stopped in s: {each}", flush=True)


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


# The locks that claim the ports free_port has handed out in this process.
_port_locks: list[int] = []


def _claim(port: int) -> bool:
    """Claims `port` against every process that picks ports with free_port, such as the other
    group of scripts running beside this one, and against this process's own earlier picks (a
    lock taken through one open file refuses another open of the same file, in any process):
    an exclusive lock on a file named for the port, held until this process exits (the kernel
    drops it then, even after a kill -9)."""
    import fcntl
    import tempfile

    folder = Path(tempfile.gettempdir()) / "kvconnect-test-ports"
    try:
        if not folder.is_dir():
            folder.mkdir(exist_ok=True)
            # Shared like /tmp, so that another user's tests can claim ports there too (a lock
            # needs only a file opened for reading); whoever made it sets this.
            with contextlib.suppress(OSError):
                folder.chmod(0o1777)
        fd = os.open(folder / str(port), os.O_CREAT | os.O_RDONLY, 0o644)
    except OSError as e:
        raise Failed(f"cannot claim port {port} in {folder} ({e}); make the folder writable, or set TMPDIR to one that is")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _port_locks.append(fd)
    return True


def free_port() -> int:
    """A port that is free now and outside the kernel's ephemeral range, and not one handed
    out before to this process or to another that is running. A port the kernel hands out
    (bind to 0) is released before the server binds it, and in between vLLM's own sockets of a
    server starting beside it may be given the same one (`Address already in use` at startup);
    below the range the kernel gives none away, so only another pick could collide: a pick that
    is taken is skipped, and so is one handed out earlier, which a test may not have bound yet
    (a server's HTTP port equal to another's KV event replay port left it answering zmq, never
    healthy). Picks, this process's and another's, are kept apart by a lock on a file per port."""
    import random

    lo, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not _claim(port):
            continue
        return port
    raise Failed(f"no free port below the ephemeral range ({lo}) after 200 tries")


def placed(core: int) -> int:
    """The CPU a server asked to run on `core` gets: the `core`-th of this process's CPUs,
    moved on by KVCONNECT_VLLM_CORE_SHIFT (default 0) places. Two groups of scripts side by side
    run with different shifts, so that their prefill and single servers (`core` 0) do not all
    share one CPU while another idles (scripts/vllm-tests.sh)."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        shift = int(os.environ.get("KVCONNECT_VLLM_CORE_SHIFT", "0"))
    except ValueError:
        raise Failed(f"KVCONNECT_VLLM_CORE_SHIFT={os.environ['KVCONNECT_VLLM_CORE_SHIFT']!r}: give a whole number")
    return cpus[(core + shift) % len(cpus)]


def serve_args(model: str, port: int, tp: int = 1, args=(), kv_config=None) -> list[str]:
    """A test server's command-line arguments to vLLM's OpenAI API server."""
    cmd = [
        "--model", model, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK),
        "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
    ]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    cmd += list(args)
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd


class Server:
    def __init__(self, name: str, model: str, logdir: Path, core: int, kv_config=None, extra_env=None, args=(),
                 tp: int = 1, whole: bool = False):
        """`core`: the CPU core the server's workers run on; at `tp` > 1 (vLLM's `mp` executor,
        one worker process per rank) every rank shares it. A server whose requests hold
        blocks for a peer keeps stepping until the peer has read them, so a prefill and a
        decode on the same cores would starve each other; on their own cores they behave as
        on their own machines. `whole`: every process of the server (its API server and
        engine core too, which vLLM leaves unpinned) runs on that core, so a server's busy
        loop never takes the other server's core: what timings need."""
        self.name = name
        core = placed(core)
        self.core = core
        self.whole = whole
        # Threads a whole server had moved off its core, put back once it was up.
        self.moved_back = 0
        self.port = free_port()
        self.log_path = logdir / f"{name}.log"
        cmd = ["taskset", "-c", str(core)] if whole else []
        cmd += [sys.executable, "-c", SERVE] + serve_args(model, self.port, tp, args, kv_config)
        env = dict(os.environ)
        # VLLM_LOG_STATS_INTERVAL: vLLM's stats log line (which shows the connector's transfer
        # metrics, wait_log) every second rather than every 10 s, so a check waits that long at most.
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join([str(core)] * tp),
                    "KVCONNECT_LOG": "info", "PYTHONFAULTHANDLER": "1", "VLLM_LOG_STATS_INTERVAL": "1"})
        env.update(extra_env or {})
        self.log = open(self.log_path, "w")
        self.started = time.time()
        # The name in the timing summary: a name used again gets a number.
        self.timing_key, n = name, 1
        while self.timing_key in _timings:
            n += 1
            self.timing_key = f"{name}#{n}"
        _timings[self.timing_key] = [None, None]
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
                    _timings[self.timing_key][0] = time.time() - self.started
                    if self.whole:
                        self.moved_back = self.keep_on_core()
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise Failed(f"{self.name} not healthy within {timeout} s\n{self.tail()}")

    def keep_on_core(self) -> int:
        """Puts every thread of this server's processes (its session: API server, engine core,
        workers) back on its core, and says how many were elsewhere. vLLM's NixlConnector on
        CPU moves its worker's main thread, which runs the model, to the last core of each NUMA
        node as it starts (`os.sched_setaffinity` in its worker, to keep a core for transfers),
        whatever the process was started on: where each server has one core, that is another
        server's, and its prefill then computes on decode's core."""
        moved = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                session = int(stat[stat.rindex(")") + 2:].split()[3])
                threads = os.listdir(f"/proc/{pid}/task")
            except (OSError, ValueError, IndexError):
                continue  # gone, or not readable: not this server's
            if session != self.proc.pid:
                continue
            for tid in map(int, threads):
                try:
                    if os.sched_getaffinity(tid) != {self.core}:
                        os.sched_setaffinity(tid, {self.core})
                        moved += 1
                except OSError:
                    pass  # the thread ended
        if moved:
            print(f"  [{self.name}] {moved} thread(s) had left core {self.core}; put back", flush=True)
        return moved

    def pause(self) -> None:
        """Stops every process of the server (SIGSTOP to its process group) until `resume`:
        a pair not being measured, whose idle loops would otherwise take the measured pair's
        cores."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

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
            began = time.time()
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            _timings[self.timing_key][1] = time.time() - began
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


def compat_hash(log: str) -> str:
    """The compat hash the adapter's worker logged for its own negotiation."""
    for line in log.splitlines():
        if "kvconnect worker: connector" in line and "compat hash " in line:
            return line.split("compat hash ")[1].split(";")[0].split()[0]
    raise Failed("no compat hash in the log")


def joint_peer_hash(log: str) -> str:
    """The peer's compat hash the adapter logged when it negotiated jointly."""
    for line in log.splitlines():
        if "kvconnect worker: connector" in line and "negotiates compat hash " in line:
            return line.split("negotiates compat hash ")[1].split()[0]
    raise Failed("the adapter did not log a joint negotiation")


def write_deployment(path: Path, model: str, prefill: dict, decode: dict) -> Path:
    """A kvconnect deployment file (as `kvconnect plan --joint` reads) for the served model."""
    path.write_text(f"model = {json.dumps(str(Path(model) / 'config.json'))}\n\n"
                    f"[prefill]\nkv_transfer_config = '{json.dumps(prefill)}'\n\n"
                    f"[decode]\nkv_transfer_config = '{json.dumps(decode)}'\n")
    return path


def tokens_of(resp: dict) -> list:
    c = resp["choices"][0]
    return c.get("token_ids") or c["text"]



def kv_config(role: str, inner, port=None, cls="KvconnectConnector", **adapter) -> dict:
    """The adapter's kv-transfer-config: `inner` is the kvconnect kv-transfer-config (None
    with adapter key `deployment`, which names both roles')."""
    extra = dict(adapter) if inner is None else {"kvconnect": inner, **adapter}
    if port is not None:
        extra["side_channel_port"] = port
    return {"kv_connector": cls, "kv_connector_module_path": "kvconnect.vllm",
            "kv_role": role, "kv_connector_extra_config": extra}


def loadable(prompt: list[int]) -> int:
    """The tokens decode loads from its producer: every prompt token but the last, which it
    computes to sample the first output token (a load may end inside a block)."""
    return max(0, len(prompt) - 1)


def external_tokens(log: str) -> list[int]:
    """The external tokens the adapter's scheduler logged, one entry per request that loads."""
    out = []
    for line in log.splitlines():
        if "kvconnect scheduler: request" in line and "external tokens" in line:
            out.append(int(line.split(" loads ")[1].split()[0]))
    return out


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus metric's samples on a vLLM server's /metrics (0 when absent);
    `labels` (e.g. 'source="lmcache_cpu"') selects samples carrying it."""
    text = requests.get(url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if labels and labels not in line:
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_metric(url: str, name: str, want: float, labels: str = "", timeout: float = 60) -> float:
    """Polls /metrics until the metric reaches `want` (vLLM publishes connector stats a step
    after they happen); returns the last value."""
    deadline = time.time() + timeout
    while True:
        v = metric(url, name, labels)
        if v >= want or time.time() > deadline:
            return v
        time.sleep(1)


def wait_log(server: "Server", text: str, timeout: float = 60) -> bool:
    """Waits for `text` in the server's log (vLLM logs its stats every VLLM_LOG_STATS_INTERVAL,
    1 s in Server's environment)."""
    deadline = time.time() + timeout
    while text not in server.text():
        if time.time() > deadline:
            return False
        time.sleep(1)
    return True


class KvEvents:
    """vLLM's KV event batches from its zmq publisher, read as vLLM's docs write a subscriber:
    a SUB socket and `msgspec.msgpack.Decoder(KVEventBatch)`, vLLM's own classes. `bind`: this
    end binds `endpoint` (vLLM's publisher connects to an endpoint that names a host, and binds
    only a wildcard one); otherwise it connects."""

    def __init__(self, endpoint: str, topic: bytes = b"", bind: bool = False):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        if bind:
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self._events = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import zmq

        while not self._stop:
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = self._decoder.decode(payload)
            with self._lock:
                self._events.extend(batch.events)

    def snapshot(self) -> list:
        """Every event received so far, in order."""
        with self._lock:
            return list(self._events)

    def of(self, cls_name: str, medium: str) -> list:
        return [e for e in self.snapshot() if type(e).__name__ == cls_name and e.medium == medium]

    def hashes(self, cls_name: str, medium: str) -> set:
        return {h for e in self.of(cls_name, medium) for h in e.block_hashes}

    def wait(self, cls_name: str, medium: str, want: int, timeout: float = 30) -> set:
        """The hashes of `cls_name` events on `medium`, once there are `want` of them or
        `timeout` seconds have passed."""
        deadline = time.time() + timeout
        while len(self.hashes(cls_name, medium)) < want and time.time() < deadline:
            time.sleep(0.5)
        return self.hashes(cls_name, medium)

    def close(self):
        self._stop = True
        self._thread.join(5)
        self._sock.close(0)


@contextlib.contextmanager
def serving(*servers: "Server"):
    """Stops `servers` when the block ends; on a failed check, prints their logs' tails first."""
    try:
        yield
    except Failed:
        for s in servers:
            print(s.tail(), file=sys.stderr)
        raise
    finally:
        for s in servers:
            s.stop()


@contextlib.contextmanager
def stopped(servers, enabled: bool = True):
    """Stops `servers` (`Server.pause`) for the block when `enabled`, and continues them after
    it whatever it did. The stops happen inside the block's `try`: a server stopped and never
    continued would not take the SIGTERM that ends the run."""
    try:
        if enabled:
            for s in servers:
                s.pause()
        yield
    finally:
        if enabled:
            for s in servers:
                s.resume()


def run_refused(model: str, logdir: Path, name: str, inner, want: str, cls="KvconnectConnector", config=None):
    """vLLM must stop at startup with kvconnect's one-line message containing `want`;
    `config` replaces the kv-transfer-config made from `inner`."""
    srv = Server(name, model, logdir, core=0,
                 kv_config=config or kv_config("kv_both", inner, port=free_port(), cls=cls))
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


def run_refused_in_process(model: str, cases) -> None:
    """Each case (name, kv-transfer-config, `want`) refused as a vLLM server's startup refuses
    it, without the server: vLLM's own parser reads a test server's arguments (serve_args),
    vLLM builds its config from them (the hybrid KV cache manager's decision included), and
    vLLM's connector factory makes the connector's scheduler half, as the engine core does as
    it starts. That must raise kvconnect's error containing `want`. One import of vLLM serves
    every case, where each refused server start costs three processes importing it;
    `run_refused` checks a refusal end to end, through the server's exit."""
    from kvconnect import _kvconnect
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name, config, want in cases:
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_args(model, free_port(), kv_config=config))
        try:
            vllm_config = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
            KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, None)
        except Exception as e:
            if not isinstance(e, _kvconnect.KvconnectError):
                raise Failed(f"{name}: refused by {type(e).__name__}, not kvconnect's error: {e}")
            if want not in str(e):
                raise Failed(f"{name}: refused with kvconnect's message, but without {want!r}: {e}")
            print(f"ok: {name} refused as vLLM starts (its config and connector made in process): {str(e)[:400]}")
            continue
        raise Failed(f"{name}: vLLM made its config and kvconnect's connector; expected kvconnect's refusal ({want!r})")


def run_checks(name: str, keep: bool, checks, kind: str = "llama") -> None:
    """Builds the tiny model in a fresh directory and runs `checks(model, logdir)`; on
    `Failed` prints it with where the logs are and exits 1, else removes the directory
    (unless `keep`)."""
    import shutil
    import tempfile

    # A runner that stops this one (`timeout`, CI) with SIGTERM unwinds it like an exception,
    # so every server it started is stopped too (they run in their own sessions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix=f"kvconnect-vllm-{name}-"))
    model = str(tmp / "model")
    make_tiny_model.build(model, kind)
    try:
        checks(model, tmp)
    except Failed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        print(f"logs in {tmp}", file=sys.stderr)
        sys.exit(1)
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"all vLLM {name} checks passed")

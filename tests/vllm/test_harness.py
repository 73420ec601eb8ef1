"""The benchmarks' and tests' own tools, without vLLM servers: `harness.stopped`, which stops
the servers of the side not being timed, on a stand-in server (a `sleep` in its own session,
as a server's processes are), checked in /proc; and `harness.free_port`, which never hands
out the same port twice (a test takes several before its servers bind any), nor one another
running process was handed (the two groups of scripts run side by side).

    VENV/bin/python tests/vllm/test_harness.py
"""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Failed, Server, free_port, stopped  # noqa: E402


def state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def settled(pid: int, want: str) -> str:
    """The process's state once it is `want`, or whatever it is after 5 s."""
    deadline = time.time() + 5
    while (s := state(pid)) != want and time.time() < deadline:
        time.sleep(0.01)
    return s


def stand_in() -> Server:
    s = Server.__new__(Server)
    s.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    return s


def check_free_ports():
    # 400 picks from a range of 12,000: with repeats allowed, some two of them would almost
    # surely be equal (the odds of none are about e^-6.6).
    ports = [free_port() for _ in range(400)]
    if len(set(ports)) != len(ports):
        raise Failed(f"free_port handed out {len(ports) - len(set(ports))} ports twice in {len(ports)} picks")
    # Another process picking at the same time (the other group of scripts) gets other ports:
    # two sets of 300 picks, unclaimed, would share about 7.
    here = Path(__file__).resolve().parent
    child = subprocess.Popen(
        [sys.executable, "-c", f"import json, sys; sys.path.insert(0, {str(here)!r}); from harness import free_port; "
         "print(json.dumps([free_port() for _ in range(300)]), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        theirs = set(json.loads(child.stdout.readline()))
        mine = {free_port() for _ in range(300)}
    finally:
        child.stdin.close()
        child.wait(30)
    shared = (mine | set(ports)) & theirs
    if len(theirs) != 300 or shared:
        raise Failed(f"another process was handed {len(shared)} of this one's ports: {sorted(shared)[:10]}")


def main():
    check_free_ports()
    servers = [stand_in(), stand_in()]
    pids = [s.proc.pid for s in servers]
    try:
        with stopped(servers):
            got = [settled(p, "T") for p in pids]
            if got != ["T", "T"]:
                raise Failed(f"inside the block the servers are {got}, not stopped")
        got = [settled(p, "S") for p in pids]
        if got != ["S", "S"]:
            raise Failed(f"after the block the servers are {got}, not continued")
        # A failure inside the block continues them too, and still propagates.
        try:
            with stopped(servers):
                raise KeyError("inside")
        except KeyError:
            pass
        else:
            raise Failed("the block's error did not propagate")
        got = [settled(p, "S") for p in pids]
        if got != ["S", "S"]:
            raise Failed(f"after a failed block the servers are {got}, not continued")
        # Not enabled: nothing is stopped.
        with stopped(servers, enabled=False):
            time.sleep(0.2)
            got = [state(p) for p in pids]
            if "T" in got:
                raise Failed(f"with enabled=False the servers are {got}")
    finally:
        for s in servers:
            s.proc.kill()
            s.proc.wait()
    print("all harness checks passed")


if __name__ == "__main__":
    try:
        main()
    except Failed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)

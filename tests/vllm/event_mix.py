"""How many blocks an event of vLLM's own KV event stream carries, in a steady state that
evicts: what "events per second" counts for a router fed by vLLM (BENCHMARKS.md, the KV
router's rows).

One vLLM server with its prefix cache (on by default), a KV cache of `--blocks` blocks
(`--num-gpu-blocks-override`) and `--kv-events-config` (zmq publisher); a subscriber built on
vLLM's own `KVEventBatch` decoder reads the stream. `--requests` requests, four at a time,
each a shared document of three blocks (one of `--documents`) followed by tokens of its own,
fill the cache many times over, so vLLM evicts as it goes. Prints, for each kind of event,
how many came and how many blocks they carried.

    VENV/bin/python tests/vllm/event_mix.py [--requests 160] [--blocks 48] [--keep]

Exit status 0 when the stream was read and the cache evicted (without evictions it would not
show a steady state).
"""

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, Failed, KvEvents, Server, complete, free_port, make_tiny_model, run_checks, serving, tokens_of,
)

DOC_BLOCKS = 3
# The tiny model's context is 256 tokens: a prompt and its answer stay under it.
PROMPT_LEN = 200
MAX_TOKENS = 40


def measure(model: str, logdir: Path, requests: int, blocks: int, documents: int):
    rng = random.Random(5)
    docs = [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(documents)]
    prompts = [rng.choice(docs) + [rng.randrange(4, make_tiny_model.VOCAB) for _ in range(PROMPT_LEN - DOC_BLOCKS * BLOCK)]
               for _ in range(requests)]
    port = free_port()
    sub = KvEvents(f"tcp://127.0.0.1:{port}", b"kv")
    srv = Server("event-mix", model, logdir, core=0,
                 args=["--num-gpu-blocks-override", str(blocks), "--kv-events-config",
                       f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                       f'"endpoint": "tcp://*:{port}", "topic": "kv"}}'])
    with serving(srv):
        srv.wait_healthy()
        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda ip: tokens_of(complete(srv.url, ip[1], f"mix-{ip[0]}", max_tokens=MAX_TOKENS)),
                                 enumerate(prompts)))
        # The last steps' batches reach the subscriber after the last answer.
        time.sleep(2)
    events = sub.snapshot()
    sub.close()
    if len(done) != requests:
        raise Failed(f"{len(done)} of {requests} requests answered")
    kinds = {}
    for e in events:
        n, b = kinds.get(type(e).__name__, (0, 0))
        kinds[type(e).__name__] = (n + 1, b + len(getattr(e, "block_hashes", ())))
    stored, removed = kinds.get("BlockStored", (0, 0)), kinds.get("BlockRemoved", (0, 0))
    if removed[1] == 0:
        raise Failed(f"no block was evicted from a cache of {blocks} blocks by {requests} requests: no steady "
                     f"state to count; events: {kinds}\n{srv.tail()}")
    total_events = sum(n for n, _ in kinds.values())
    total_blocks = sum(b for _, b in kinds.values())
    print(f"vLLM's own KV events, {requests} requests of {PROMPT_LEN} prompt and {MAX_TOKENS} answer tokens through a "
          f"cache of {blocks} blocks of {BLOCK} tokens:")
    for name, (n, b) in sorted(kinds.items()):
        print(f"  {name}: {n} events, {b} blocks, {b / n:.2f} blocks per event")
    print(f"  all: {total_events} events, {total_blocks} blocks, {total_blocks / total_events:.2f} blocks per event; "
          f"blocks removed per block stored {removed[1] / max(stored[1], 1):.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--blocks", type=int, default=48, help="the KV cache's blocks (vLLM's --num-gpu-blocks-override)")
    ap.add_argument("--documents", type=int, default=8, help="shared documents the prompts start with")
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    a = ap.parse_args()
    run_checks("event-mix", a.keep, lambda model, logdir: measure(model, logdir, a.requests, a.blocks, a.documents))


if __name__ == "__main__":
    main()

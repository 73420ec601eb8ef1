"""lmcache's tier events through vLLM's own KV event publisher, read with vLLM's own classes.

One vLLM server with KvconnectConnector over lmcache (a CPU tier of about three chunks and
a disk tier) and `--kv-events-config` (zmq publisher, topic `kv`); a subscriber built on
vLLM's `KVEventBatch` decoder reads it. Prompts of three chunks each overflow the CPU tier,
so chunks move to disk. The subscriber must see:

- every chunk stored in `cpu_tier` as vLLM's `BlockStored`, with the chunk's token ids, the
  chunk size as block size and the previous chunk as parent;
- chunks moved to disk as a `BlockRemoved` from `cpu_tier` and a `BlockStored` on `disk`
  with the same hash and tokens;
- the stream consistent: replayed in order, no chunk stored twice in a tier, none removed
  from a tier that did not hold it.

    VENV/bin/python tests/vllm/test_events.py [--keep]

Exit status 0 when every check passed.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BLOCK, Failed, KvEvents, Server, complete, free_port, kv_config, make_tiny_model, run_checks, serving, tokens_of,
)

# The tiny model's KV: 2 layers x (K, V) x 2 heads x 64 channels x 2 bytes = 1 KiB a token.
CHUNK_BYTES = BLOCK * 1024
PROMPTS = 4
PROMPT_LEN = 3 * BLOCK + 5


def tier_events(events, medium):
    return [e for e in events if getattr(e, "medium", None) == medium]


def check_events(model: str, logdir: Path):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    rng = random.Random(41)
    prompts = [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    inner = {"kv_connector": "LMCacheConnectorV1",
             "kv_connector_extra_config": {
                 "chunk_size": BLOCK,
                 # Room for three chunks and a half: later chunks push earlier ones to disk.
                 "max_local_cpu_size": 3.5 * CHUNK_BYTES / 2**30,
                 "local_disk": str(logdir / "lmcache-disk"),
                 "max_local_disk_size": 0.01}}
    port = free_port()
    sub = KvEvents(f"tcp://127.0.0.1:{port}", b"kv")
    srv = Server("events-lmcache", model, logdir, core=0, kv_config=kv_config("kv_both", inner),
                 args=["--kv-events-config",
                       f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                       f'"endpoint": "tcp://*:{port}", "topic": "kv"}}'])
    with serving(srv):
        srv.wait_healthy()
        for i, p in enumerate(prompts):
            tokens_of(complete(srv.url, p, f"events-{i}"))
        want_chunks = PROMPTS * (PROMPT_LEN // BLOCK)
        deadline = time.time() + 60
        while time.time() < deadline:
            ev = sub.snapshot()
            if len(tier_events([e for e in ev if isinstance(e, BlockStored)], "cpu_tier")) >= want_chunks and \
                    tier_events([e for e in ev if isinstance(e, BlockStored)], "disk"):
                break
            time.sleep(0.5)
        # A last step carries what the disk writer finished after the others.
        tokens_of(complete(srv.url, prompts[0][:40], "events-last"))
        time.sleep(2)
    events = sub.snapshot()
    sub.close()

    stored_cpu = [e for e in tier_events(events, "cpu_tier") if isinstance(e, BlockStored)]
    if len(stored_cpu) != want_chunks:
        raise Failed(f"{len(stored_cpu)} chunks stored in cpu_tier reached vLLM's publisher, expected "
                     f"{want_chunks}; events: {events[:12]}\n{srv.tail()}")
    # Each chunk: its prompt's tokens, the chunk size, the previous chunk as parent.
    by_hash = {}
    for e in stored_cpu:
        if len(e.block_hashes) != 1 or e.block_size != BLOCK or len(e.token_ids) != BLOCK:
            raise Failed(f"a cpu_tier store is not one chunk of {BLOCK} tokens: {e}")
        by_hash[e.block_hashes[0]] = e
    for i, p in enumerate(prompts):
        parent = None
        for c in range(PROMPT_LEN // BLOCK):
            chunk = p[c * BLOCK:(c + 1) * BLOCK]
            match = [e for e in stored_cpu if list(e.token_ids) == chunk]
            if len(match) != 1:
                raise Failed(f"prompt {i} chunk {c}: {len(match)} cpu_tier stores carry its tokens")
            if match[0].parent_block_hash != parent:
                raise Failed(f"prompt {i} chunk {c}: parent {match[0].parent_block_hash}, expected {parent}")
            parent = match[0].block_hashes[0]
    print(f"ok: {len(stored_cpu)} lmcache chunks reached vLLM's publisher as BlockStored (medium 'cpu_tier') "
          f"with their tokens, block size {BLOCK} and parent")

    # Replayed in order: a consistent index, and the moves to disk.
    held = set()
    moves = 0
    for e in events:
        if isinstance(e, AllBlocksCleared):
            held.clear()
            continue
        if e.medium not in ("cpu_tier", "disk"):
            continue  # vLLM's own prefix cache
        for h in e.block_hashes:
            key = (h, e.medium)
            if isinstance(e, BlockStored):
                if key in held:
                    raise Failed(f"chunk {h} stored twice on {e.medium}")
                held.add(key)
                if e.medium == "disk":
                    src = by_hash.get(h)
                    if src is None or list(src.token_ids) != list(e.token_ids):
                        raise Failed(f"chunk {h} on disk does not carry the tokens it had in cpu_tier")
                    if (h, "cpu_tier") not in held:
                        moves += 1
            elif isinstance(e, BlockRemoved):
                if key not in held:
                    raise Failed(f"chunk {h} removed from {e.medium}, which did not hold it")
                held.discard(key)
    on_cpu = sum(1 for _, m in held if m == "cpu_tier")
    if moves == 0 or on_cpu > 3:
        raise Failed(f"{moves} chunks moved from cpu_tier to disk, {on_cpu} left in cpu_tier (room for 3): "
                     f"the CPU tier did not overflow into the disk as the events tell it\n{srv.tail()}")
    print(f"ok: {moves} chunks moved from cpu_tier to disk, each as BlockRemoved (cpu_tier) + BlockStored (disk); "
          f"{on_cpu} chunks left in cpu_tier, {len(held) - on_cpu} on disk")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the model and logs")
    a = ap.parse_args()
    run_checks("events", a.keep, check_events)


if __name__ == "__main__":
    main()

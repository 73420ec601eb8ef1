"""vLLM's GPU worker and scheduler calls, made from Python with torch CUDA tensors through
the adapter's core (`kvconnect.core`), without vLLM.

    python tests/gpu/driver.py            # every case; skips, saying why, without CUDA
    python tests/gpu/driver.py --bench    # also the benchmark against torch's own copies
    python tests/gpu/driver.py --only pd-fa-hnd-bf16,lmcache-fa-nhd-bf16

Each case allocates its KV caches as vLLM's GPU backends do: FlashAttention's
`(2, num_blocks, block_size, heads, head_dim)` (NHD, or the same logical shape over HND
memory), MLA's `(num_blocks, block_size, kv_lora_rank + rope_dim)`, bf16 or fp8 (a uint8
tensor, as vLLM allocates fp8). Every source block holds seeded random bytes.

- `pd-*`: prefill and decode in two processes on one GPU, nixl over cuda_ipc (HND or MLA:
  nixl, like vLLM's NixlConnector, moves FlashAttention KV in HND only, and
  `pd-fa-nhd-refused` checks that an NHD engine is refused at startup, saying so). Prefill
  computes each request (save_kv_layer per layer, wait_for_save) and finishes it with
  `do_remote_decode`; decode takes its kv_transfer_params, loads asynchronously and steps
  until `finished` reports the request. Every loaded token is compared byte for byte with
  torch's indexing of the source (regenerated from its seed), and every other byte of
  decode's cache must keep its poison.
- `lmcache-*`, `flexkv-*`: one process; a first request saves from the device tensors, a
  second with the same prompt loads into other blocks of the same tensors, checked likewise.
- `--bench`: a 28-layer HND cache (8 KV heads x 128, block 16, 2048 blocks) and requests of
  512 scattered blocks (896 MiB), and the same bytes in blocks of 128 tokens: the adapter's
  load end to end (from `start_load_kv` until `finished` reports it) against torch's own
  gather of the same bytes in decode's process (`index_select` into a contiguous buffer,
  then `index_copy_` into the destination) and against one contiguous copy, each timed
  right after a load (15 interleaved pairs; the ratio is the median of the pairs', with
  quartiles), and the adapter's per-step overhead (an idle step; prefill's saving step).

Prints one `PASS`/`FAIL`/`skipping` line per case and a JSON line per benchmark; exits 1 if
any case failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

import torch

POISON = 0xA5
TIMEOUT_S = 120.0
# Where the KV caches live: `cuda` (cuda_ipc between prefill and decode) or, with --device
# cpu, host memory (the nixl tcp backend): the same calls on a machine without a GPU.
DEV = os.environ.get("KVCONNECT_DRIVER_DEVICE", "cuda")
BACKEND = "cuda_ipc" if DEV == "cuda" else "tcp"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


# ---- the model and its KV cache tensors ----

def hf_config(mla: bool, layers: int, heads: int, head_dim: int) -> dict:
    if mla:
        return {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 16,
                "hidden_size": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                "v_head_dim": 128, "q_lora_rank": None, "torch_dtype": "bfloat16"}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
            "num_attention_heads": heads * 4, "num_key_value_heads": heads, "head_dim": head_dim,
            "hidden_size": heads * 4 * head_dim, "torch_dtype": "bfloat16"}


class Case:
    """One configuration: connector, layout (`NHD`, `HND` or `MLA`), dtype and sizes."""

    def __init__(self, name: str, connector: str, layout: str, dtype: str, layers: int = 4, blocks: int = 0,
                 block_size: int = 16, heads: int = 4, head_dim: int = 128, request_blocks: int = 20, requests: int = 3):
        self.name, self.connector, self.layout, self.dtype = name, connector, layout, dtype
        self.layers, self.blocks, self.block_size = layers, blocks, block_size
        self.heads, self.head_dim = heads, head_dim
        self.request_blocks, self.requests = request_blocks, requests
        if not blocks:
            # Each layer's tensor at least 16 MiB: PyTorch gives such a tensor an allocation
            # of its own (vLLM's are far larger), which is what a CUDA IPC handle exports.
            self.blocks = max(256, -(-(16 << 20) // self.layer_block_bytes() // 64) * 64)

    def layer_block_bytes(self) -> int:
        esize = 1 if self.dtype == "fp8" else 2
        per_token = (512 + 64) if self.mla else 2 * self.heads * self.head_dim
        return self.block_size * per_token * esize

    @property
    def mla(self) -> bool:
        return self.layout == "MLA"

    def torch_dtype(self):
        return torch.uint8 if self.dtype == "fp8" else torch.bfloat16

    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]

    def setup(self, role: str, engine_id: str, extra: dict) -> str:
        from kvconnect.core import setup_json

        return setup_json(kv_role=role, engine_id=engine_id, extra_config=extra,
                          hf_config=hf_config(self.mla, self.layers, self.heads, self.head_dim),
                          block_size=self.block_size, cache_dtype="fp8" if self.dtype == "fp8" else "auto",
                          model_dtype="bfloat16", kv_device=DEV,
                          kv_cache_layout="NHD" if self.mla else self.layout)

    def allocate(self, fill: str, seed: int = 0) -> "Caches":
        """Every layer's tensor: `fill` is `random` (seeded bytes) or `poison`."""
        return Caches(self, fill, seed)


class Caches:
    """A case's per-layer tensors as vLLM's backends allocate them: `storage` is the memory
    in its physical order, `logical` the tensor vLLM hands the connector, `bytes` a uint8
    view of `logical` with each element's bytes innermost."""

    def __init__(self, case: Case, fill: str, seed: int):
        self.case = case
        self.storage, self.logical, self.bytes = [], [], []
        c = case
        for layer in range(c.layers):
            if c.mla:
                phys = (c.blocks, c.block_size, 512 + 64)
            elif c.layout == "HND":
                phys = (2, c.blocks, c.heads, c.block_size, c.head_dim)
            else:
                phys = (2, c.blocks, c.block_size, c.heads, c.head_dim)
            s = torch.empty(phys, dtype=c.torch_dtype(), device=DEV)
            raw = s.view(torch.uint8)
            if fill == "random":
                g = torch.Generator(device=DEV)
                g.manual_seed(seed * 1000 + layer)
                raw.random_(0, 256, generator=g)
            else:
                raw.fill_(POISON)
            if c.layout == "HND":
                logical, lbytes = s.permute(0, 1, 3, 2, 4), raw.permute(0, 1, 3, 2, 4)
            else:
                logical, lbytes = s, raw
            self.storage.append(s)
            self.logical.append(logical)
            self.bytes.append(lbytes)

    def poison(self, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, device=DEV)
        for s in self.storage:
            (s if self.case.mla else s[0]).view(torch.uint8)[idx] = POISON
            if not self.case.mla:
                s[1].view(torch.uint8)[idx] = POISON

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.case.layer_names(), self.logical))

    def tokens(self, layer: int, blocks: list[int], n: int) -> torch.Tensor:
        """The bytes of the first `n` tokens held in `blocks`, by torch's indexing."""
        bs = self.case.block_size
        idx = torch.tensor(blocks, device=DEV)
        b = self.bytes[layer]
        if self.case.mla:
            sel = b[idx].reshape(len(blocks) * bs, -1)
            return sel[:n]
        sel = b[:, idx].reshape(2, len(blocks) * bs, *b.shape[3:])
        return sel[:, :n]


def layer_index(name: str) -> int:
    return int(name.split(".")[2])


def slot_mapping(blocks: list[int], n: int, block_size: int) -> torch.Tensor:
    """vLLM's slot mapping for the first `n` tokens of a request holding `blocks`."""
    b = torch.tensor(blocks, dtype=torch.int64, device=DEV)
    t = torch.arange(n, dtype=torch.int64, device=DEV)
    return b[t // block_size] * block_size + t % block_size


def check_loaded(case: Case, dst: Caches, dst_blocks: list[int], src: Caches, src_blocks: list[int], n: int,
                 poisoned_elsewhere: bool = True) -> None:
    """The first `n` tokens of `dst_blocks` equal those of `src_blocks` byte for byte; every
    other byte of `dst` outside `src`'s blocks still holds the poison."""
    sync()
    bs = case.block_size
    used = (n + bs - 1) // bs
    for layer in range(case.layers):
        got = dst.tokens(layer, dst_blocks[:used], n)
        want = src.tokens(layer, src_blocks[:used], n)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            raise AssertionError(f"{case.name}: layer {layer}: loaded bytes differ from the source's "
                                 f"({bad.shape[0]} bytes, first at {bad[0].tolist()})")
        if not poisoned_elsewhere:
            continue
        keep = torch.ones(case.blocks, dtype=torch.bool, device=DEV)
        keep[torch.tensor(dst_blocks[:used], device=DEV)] = False
        b = dst.bytes[layer]
        rest = b[keep] if case.mla else b[:, keep]
        if not bool((rest == POISON).all()):
            raise AssertionError(f"{case.name}: layer {layer}: a block that was not to be loaded was written")
        if n % bs:
            tail = dst.bytes[layer]
            last = dst_blocks[used - 1]
            t = tail[last, n % bs:] if case.mla else tail[:, last, n % bs:]
            if not bool((t == POISON).all()):
                raise AssertionError(f"{case.name}: layer {layer}: tokens past the {n} loaded were written")


# ---- one engine's halves, stepped as vLLM steps them ----

class Engine:
    """A worker half and a scheduler half (in one process here, as the scheduler process's
    half talks to the worker's over its socket in vLLM) over `caches`."""

    def __init__(self, case: Case, role: str, engine_id: str, extra: dict, caches: Caches):
        from kvconnect.core import SchedulerCore, WorkerCore

        setup = case.setup(role, engine_id, extra)
        self.case = case
        self.worker = WorkerCore(setup, case.block_size)
        self.caches = caches
        self.side_channel = self.worker.register_kv_caches(caches.as_dict(), layer_index, case.blocks)
        self.sched = SchedulerCore(setup)
        self.sched.attach([self.worker.scheduler_socket()])
        self.finished_ids: list[str] = []
        self.step_us: list[float] = []

    def step(self, scheduled: list[str], slots: torch.Tensor | None = None):
        """One forward step: metadata, loads, every layer (waiting for its load, saving it
        when `slots` is given), the save barrier and the finished sets."""
        t0 = time.perf_counter()
        meta = self.sched.build_connector_meta(scheduled, self.finished_ids)
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv()
        for name in self.case.layer_names():
            w.wait_for_layer_load(name)
            w.save_kv_layer(name, slots)
        w.wait_for_save()
        out = w.finished(set(self.finished_ids))
        w.clear_connector_metadata()
        self.step_us.append((time.perf_counter() - t0) * 1e6)
        self.finished_ids = []
        return out


def prompt_of(rid: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(rid)
    return torch.randint(4, 1000, (n,), generator=g).tolist()


def scattered(case: Case, count: int, seed: int, exclude=()) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ex = set(exclude)
    return [b for b in torch.randperm(case.blocks, generator=g).tolist() if b not in ex][:count]


# ---- prefill and decode over cuda_ipc, two processes ----

def prefill_proc(case: Case, port: int, conn) -> None:
    try:
        caches = case.allocate("random", seed=1)
        extra = {"kvconnect": {"kv_connector": "NixlConnector", "kv_buffer_device": DEV,
                               "kv_connector_extra_config": {"backend": BACKEND}},
                 "side_channel_port": port}
        e = Engine(case, "kv_producer", "prefill", extra, caches)
        n = case.request_blocks * case.block_size + 1
        reqs = []
        for r in range(case.requests):
            rid, prompt = f"req-{r}", prompt_of(r, n)
            blocks = scattered(case, case.request_blocks + 1, 100 + r)
            params = {"do_remote_decode": True}
            tokens, _ = e.sched.get_num_new_matched_tokens(rid, prompt, params, 0)
            assert not tokens, f"prefill matched {tokens} external tokens"
            e.sched.update_state_after_alloc(rid, prompt, params, [blocks], 0)
            e.step([rid], slot_mapping(blocks, n, case.block_size))
            sync()  # vLLM's step ends with the sampled token on the host
            delay, out = e.sched.request_finished(rid, prompt, params, [blocks])
            assert delay and out, f"prefill did not hold {rid}'s blocks for decode: {delay}, {out}"
            e.finished_ids.append(rid)
            reqs.append({"rid": rid, "prompt": prompt, "blocks": blocks, "params": out})
        conn.send(("ready", reqs, sorted(e.step_us)[len(e.step_us) // 2]))
        # Keep stepping, as vLLM does while requests hold blocks for a peer, until every
        # request was sent and the driver says stop.
        sent, stop, deadline = set(), False, time.monotonic() + TIMEOUT_S
        while not (stop and len(sent) == len(reqs)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill: requests sent {sorted(sent)} of {len(reqs)} after {TIMEOUT_S}s")
            sending, _, _ = e.step([])
            sent |= sending
            if conn.poll(0.001):
                stop = conn.recv() == "stop"
        e.worker.shutdown()
        conn.send(("done", sorted(sent)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def decode_proc(case: Case, reqs: list[dict], bench: bool, conn) -> None:
    try:
        caches = case.allocate("poison")
        extra = {"kvconnect": {"kv_connector": "NixlConnector", "kv_buffer_device": DEV,
                               "kv_connector_extra_config": {"backend": BACKEND}}}
        e = Engine(case, "kv_consumer", "decode", extra, caches)
        source = case.allocate("random", seed=1)  # prefill's bytes, regenerated from the seed
        copies = TorchCopies(case, source, caches) if bench else None
        load_s, blocks, torch_s = [], [], []
        for i, r in enumerate(reqs):
            rid, prompt = r["rid"], r["prompt"]
            tokens, is_async = e.sched.get_num_new_matched_tokens(rid, prompt, r["params"], 0)
            assert tokens and is_async, f"decode: {rid} matched ({tokens}, {is_async}), want an asynchronous load"
            blocks = scattered(case, len(r["blocks"]), 200 + i)
            e.sched.update_state_after_alloc(rid, prompt, r["params"], [blocks], tokens)
            load_s.append(load_step(e, rid))
            check_loaded(case, caches, blocks, source, r["blocks"], tokens)
            if copies is not None and i > 0:
                # torch's copies of the same bytes right after each timed load (after the
                # first, which handshakes): interleaved pairs, alternating which goes first.
                n = case.request_blocks
                torch_s.append(copies.time(r["blocks"][:n], blocks[:n], gather_first=i % 2 == 0))
            caches.poison(blocks)  # the next request's check starts from a poisoned cache
            # Decode computes the rest and finishes the request.
            e.finished_ids.append(rid)
            delay, _ = e.sched.request_finished(rid, prompt, r["params"], [blocks])
            e.step([])
        idle = []
        for _ in range(50):
            e.step([])
            idle.append(e.step_us[-1])
        result = {"load_s": load_s, "idle_step_us": sorted(idle)[len(idle) // 2],
                  "tokens": tokens, "stats": e.worker.stats()}
        if bench:
            result["torch"] = {"bytes": copies.nbytes, "pairs": torch_s}
        e.worker.shutdown()
        conn.send(("done", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def load_step(e: Engine, rid: str) -> float:
    """The step that starts `rid`'s asynchronous load, its `finished` polled until the load
    is reported (vLLM asks once per step; polling here times the transfer, not the step
    rate). Returns the seconds from `start_load_kv` to the report."""
    w = e.worker
    w.bind_connector_metadata(e.sched.build_connector_meta([], []))  # handshakes a new producer
    sync()
    t0 = time.perf_counter()
    w.start_load_kv()
    for name in e.case.layer_names():
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, None)
    w.wait_for_save()
    while True:
        _, recving, failed = w.finished(set())
        if rid in failed:
            raise AssertionError(f"decode: {rid} failed to load: {failed[rid]}")
        if rid in recving:
            break
        if time.perf_counter() - t0 > TIMEOUT_S:
            raise TimeoutError(f"decode: {rid} not loaded after {TIMEOUT_S}s")
    took = time.perf_counter() - t0
    w.clear_connector_metadata()
    return took


class TorchCopies:
    """The same bytes moved by torch in decode's process: per layer `index_select` of the
    source's blocks into a contiguous buffer, then `index_copy_` into the destination's
    blocks; and one contiguous copy of as many bytes."""

    def __init__(self, case: Case, src: Caches, dst: Caches):
        self.case, self.src, self.dst = case, src, dst
        self.dim = 0 if case.mla else 1
        self.nbytes = sum(s.view(torch.uint8).numel() // case.blocks * case.request_blocks for s in src.storage)
        self.flat_src = torch.empty(self.nbytes, dtype=torch.uint8, device=DEV)
        self.flat_dst = torch.empty_like(self.flat_src)

    @staticmethod
    def timed(f) -> float:
        sync()
        t0 = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - t0

    def time(self, src_blocks: list[int], dst_blocks: list[int], gather_first: bool) -> dict:
        """One gather and one contiguous copy, each timed alone, in the order given."""
        sidx = torch.tensor(src_blocks, device=DEV)
        didx = torch.tensor(dst_blocks, device=DEV)

        def gather():
            for s, d in zip(self.src.storage, self.dst.storage):
                d.index_copy_(self.dim, didx, s.index_select(self.dim, sidx))

        def contiguous():
            self.flat_dst.copy_(self.flat_src)

        if gather_first:
            g = self.timed(gather)
            c = self.timed(contiguous)
        else:
            c = self.timed(contiguous)
            g = self.timed(gather)
        return {"gather_s": g, "contiguous_s": c}


def run_refused(case: Case) -> dict:
    """nixl moves FlashAttention KV in HND only (as vLLM's NixlConnector): an NHD engine is
    refused at startup, naming the layout and the remedy, before any tensor is touched."""
    from kvconnect import _kvconnect
    from kvconnect.core import WorkerCore

    extra = {"kvconnect": {"kv_connector": "NixlConnector", "kv_buffer_device": DEV,
                           "kv_connector_extra_config": {"backend": BACKEND}}}
    try:
        WorkerCore(case.setup("kv_consumer", "decode", extra), case.block_size)
    except _kvconnect.KvconnectError as e:
        if "requires HND" not in str(e):
            raise AssertionError(f"refused, but not for the layout: {e}") from e
        return {"refused": str(e)[:160], "asked_for": required_layouts(case)}
    raise AssertionError("nixl accepted an NHD KV cache")


def required_layouts(case: Case) -> dict:
    """What `get_required_kvcache_layout` asks vLLM for, per connector, so that an engine run
    without VLLM_KV_CACHE_LAYOUT allocates what its connector takes: nixl HND (as vLLM's
    NixlConnector), lmcache and flexkv NHD, a composite with nixl HND, MLA none."""
    from kvconnect.core import required_kv_cache_layout

    nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": DEV,
            "kv_connector_extra_config": {"backend": BACKEND}}
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_buffer_device": DEV,
               "kv_connector_extra_config": {"chunk_size": 16}}
    flexkv = {"kv_connector": "FlexKVConnectorV1", "kv_buffer_device": DEV,
              "kv_connector_extra_config": {"cpu_cache_gb": 0.5}}
    composite = {"kv_connector": "PdConnector", "kv_buffer_device": DEV,
                 "kv_connector_extra_config": {"connectors": [lmcache, nixl]}}
    mla = Case(case.name + "-mla", "nixl", "MLA", case.dtype)
    want = [(case, "nixl", nixl, "HND"), (case, "lmcache", lmcache, "NHD"), (case, "flexkv", flexkv, "NHD"),
            (case, "lmcache+nixl", composite, "HND"), (mla, "nixl MLA", nixl, None)]
    got = {}
    for c, label, cfg, expected in want:
        got[label] = required_kv_cache_layout(c.setup("kv_consumer", "decode", {"kvconnect": cfg}))
        if got[label] != expected:
            raise AssertionError(f"{label}: the connector asks vLLM for {got[label]}, want {expected}")
    return got


def run_pd(case: Case, bench: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    prefill = ctx.Process(target=prefill_proc, args=(case, port, p_child), daemon=True)
    prefill.start()
    decode = None
    try:
        msg = recv(p_conn, "prefill")
        reqs, prefill_step_us = msg[1], msg[2]
        decode = ctx.Process(target=decode_proc, args=(case, reqs, bench, d_child), daemon=True)
        decode.start()
        result = recv(d_conn, "decode")[1]
        p_conn.send("stop")
        sent = recv(p_conn, "prefill")[1]
        if sent != sorted(r["rid"] for r in reqs):
            raise AssertionError(f"prefill reported {sent} sent, want every request")
        result["prefill_step_us"] = prefill_step_us
        return result
    finally:
        for p in (prefill, decode):
            if p is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()


def recv(conn, who: str):
    if not conn.poll(TIMEOUT_S + 30):
        raise TimeoutError(f"{who}: no answer after {TIMEOUT_S + 30}s")
    msg = conn.recv()
    if msg[0] == "error":
        raise AssertionError(f"{who} failed:\n{msg[1]}")
    return msg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- lmcache and flexkv: save from and load into the same device tensors ----

def cache_proc(case: Case, conn) -> None:
    try:
        caches = case.allocate("poison")
        extra_cfg = {"chunk_size": 16} if case.connector == "lmcache" else {"cpu_cache_gb": 0.5}
        name = "LMCacheConnectorV1" if case.connector == "lmcache" else "FlexKVConnectorV1"
        extra = {"kvconnect": {"kv_connector": name, "kv_buffer_device": DEV,
                               "kv_connector_extra_config": extra_cfg}}
        e = Engine(case, "kv_both", f"cache-{case.name}", extra, caches)
        source = case.allocate("random", seed=2)
        n = case.request_blocks * case.block_size + 1
        prompt = prompt_of(7, n)
        src_blocks = scattered(case, case.request_blocks + 1, 300)
        # The first request computes its prompt: its blocks get their bytes, then are saved.
        idx = torch.tensor(src_blocks, device=DEV)
        for s, g in zip(caches.storage, source.storage):
            if case.mla:
                s[idx] = g[idx]
            else:
                s[:, idx] = g[:, idx]
        tokens, _ = e.sched.get_num_new_matched_tokens("a", prompt, None, 0)
        assert not tokens, f"the empty store matched {tokens} tokens"
        e.sched.update_state_after_alloc("a", prompt, None, [src_blocks], 0)
        e.step(["a"], slot_mapping(src_blocks, n, case.block_size))
        delay, _ = e.sched.request_finished("a", prompt, None, [src_blocks])
        e.finished_ids.append("a")
        matched, deadline = 0, time.monotonic() + TIMEOUT_S
        whole = (n - 1) // case.block_size * case.block_size
        while (matched or 0) < whole:  # flexkv saves in the background: wait for all of it
            e.step([])
            seen = matched
            matched, is_async = e.sched.get_num_new_matched_tokens("b", prompt, None, 0)
            if matched and not seen:
                deadline = min(deadline, time.monotonic() + 2.0)  # a part matched: 2 s for the rest
            if time.monotonic() > deadline:
                if matched:
                    break
                raise TimeoutError(f"{case.name}: the saved prompt never matched")
        dst_blocks = scattered(case, case.request_blocks + 1, 301, exclude=src_blocks)
        e.sched.update_state_after_alloc("b", prompt, None, [dst_blocks], matched)
        t0 = time.perf_counter()
        _, recving, failed = e.step(["b"] if not is_async else [])
        while is_async and "b" not in recving:
            assert "b" not in failed, f"{case.name}: load failed: {failed}"
            if time.perf_counter() - t0 > TIMEOUT_S:
                raise TimeoutError(f"{case.name}: load not finished")
            _, recving, failed = e.step([])
        load_s = time.perf_counter() - t0
        # Source blocks keep their bytes; the loaded ones must equal them; the rest poison.
        check_loaded(case, caches, dst_blocks, caches, src_blocks, matched, poisoned_elsewhere=False)
        check_untouched(case, caches, src_blocks + dst_blocks, dst_blocks, matched)
        e.worker.shutdown()
        conn.send(("done", {"tokens": matched, "async": is_async, "load_s": load_s}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def check_untouched(case: Case, caches: Caches, written: list[int], loaded: list[int], n: int) -> None:
    keep = torch.ones(case.blocks, dtype=torch.bool, device=DEV)
    keep[torch.tensor(written, device=DEV)] = False
    bs = case.block_size
    for layer in range(case.layers):
        b = caches.bytes[layer]
        rest = b[keep] if case.mla else b[:, keep]
        if not bool((rest == POISON).all()):
            raise AssertionError(f"{case.name}: layer {layer}: a block that was neither saved nor loaded was written")
        used = (n + bs - 1) // bs
        for blk in loaded[used:]:
            t = b[blk] if case.mla else b[:, blk]
            if not bool((t == POISON).all()):
                raise AssertionError(f"{case.name}: layer {layer}: block {blk} past the loaded tokens was written")


def run_cache(case: Case) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=cache_proc, args=(case, b), daemon=True)
    p.start()
    try:
        return recv(a, case.name)[1]
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


CASES = [
    Case("pd-fa-nhd-refused", "nixl-refused", "NHD", "bf16"),
    Case("pd-fa-hnd-bf16", "nixl", "HND", "bf16"),
    Case("pd-fa-hnd-fp8", "nixl", "HND", "fp8"),
    Case("pd-mla-bf16", "nixl", "MLA", "bf16"),
    Case("pd-mla-fp8", "nixl", "MLA", "fp8"),
    Case("lmcache-fa-nhd-bf16", "lmcache", "NHD", "bf16"),
    Case("lmcache-fa-hnd-fp8", "lmcache", "HND", "fp8"),
    Case("lmcache-mla-bf16", "lmcache", "MLA", "bf16"),
    Case("flexkv-fa-nhd-bf16", "flexkv", "NHD", "bf16"),
    Case("flexkv-fa-hnd-bf16", "flexkv", "HND", "bf16"),
    Case("flexkv-fa-nhd-fp8", "flexkv", "NHD", "fp8"),
]

BENCH = [
    Case("bench-pd-fa-hnd-bf16", "nixl", "HND", "bf16", layers=28, blocks=2048, heads=8, head_dim=128,
         request_blocks=512, requests=16),
    # The same bytes per request in 8x fewer, 8x larger blocks: what a load costs per block.
    Case("bench-pd-fa-hnd-bf16-block128", "nixl", "HND", "bf16", layers=28, blocks=256, block_size=128,
         heads=8, head_dim=128, request_blocks=64, requests=16),
]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731
    return at(0.25), at(0.5), at(0.75)


def bench_report(case: Case, r: dict) -> dict:
    """Each load after the first (which handshakes and opens the IPC handles) paired with
    torch's copies timed right after it: the median of the per-pair ratios, with quartiles."""
    loads, pairs = r["load_s"][1:], r["torch"]["pairs"]
    vs_contig = [p["contiguous_s"] / a for a, p in zip(loads, pairs)]
    vs_gather = [p["gather_s"] / a for a, p in zip(loads, pairs)]
    ms = lambda xs: round(quartiles(xs)[1] * 1e3, 3)  # noqa: E731
    r3 = lambda q: [round(x, 3) for x in q]  # noqa: E731
    return {"bench": case.name, "bytes": r["torch"]["bytes"], "pairs": len(pairs),
            "adapter_load_ms_median": ms(loads), "adapter_load_ms_best": round(min(loads) * 1e3, 3),
            "torch_gather_ms_median": ms([p["gather_s"] for p in pairs]),
            "contiguous_copy_ms_median": ms([p["contiguous_s"] for p in pairs]),
            "adapter_vs_contiguous_q1_median_q3": r3(quartiles(vs_contig)),
            "adapter_vs_torch_gather_q1_median_q3": r3(quartiles(vs_gather)),
            "adapter_GBps_median": round(r["torch"]["bytes"] / quartiles(loads)[1] / 1e9, 1),
            "idle_step_us_median": round(r["idle_step_us"], 1),
            "prefill_save_step_us_median": round(r["prefill_step_us"], 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", action="store_true", help="also measure against torch's own copies")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same calls over host memory and the nixl tcp backend")
    args = ap.parse_args()
    global DEV, BACKEND
    os.environ["KVCONNECT_DRIVER_DEVICE"] = DEV = args.device
    BACKEND = "cuda_ipc" if DEV == "cuda" else "tcp"
    if DEV == "cuda" and not torch.cuda.is_available():
        print(f"skipping: no CUDA device for torch {torch.__version__} "
              f"(torch.cuda.is_available() is False; CUDA build: {torch.version.cuda}); "
              "--device cpu runs the same calls over host memory")
        return 0
    import kvconnect

    print(f"kvconnect {kvconnect.__version__} from {os.path.dirname(kvconnect.__file__)}; torch {torch.__version__}; "
          f"KV on {torch.cuda.get_device_name(0) if DEV == 'cuda' else 'the host'} ({BACKEND})", flush=True)
    only = {s for s in args.only.split(",") if s}
    failed = 0
    for case in CASES + (BENCH if args.bench else []):
        if only and case.name not in only:
            continue
        t0 = time.monotonic()
        try:
            if case.connector == "nixl-refused":
                r = run_refused(case)
            elif case.connector == "nixl":
                r = run_pd(case, bench=case in BENCH)
            else:
                r = run_cache(case)
            if case in BENCH:
                print(json.dumps(bench_report(case, r)), flush=True)
            r.pop("stats", None)
            print(f"PASS {case.name} ({time.monotonic() - t0:.1f}s): "
                  f"{json.dumps({k: v for k, v in r.items() if k != 'torch'})[:300]}", flush=True)
        except Exception as e:  # noqa: BLE001 - every case reports, the run goes on
            failed += 1
            print(f"FAIL {case.name} ({time.monotonic() - t0:.1f}s): {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The adapter's core, without vLLM: what `kvconnect.vllm.KvconnectConnector` does between
vLLM's objects and the native module, callable with plain values and torch tensors.

    setup = setup_json(kv_role="kv_producer", engine_id="prefill", extra_config={...},
                       hf_config={...}, block_size=16, cache_dtype="auto", model_dtype="bfloat16",
                       kv_device="cuda", kv_cache_layout="NHD")
    worker = WorkerCore(setup, block_size=16)
    worker.register_kv_caches({"model.layers.0.self_attn.attn": kv0, ...}, layer_index)
    worker.bind_connector_metadata(meta_bytes)
    worker.start_load_kv(); worker.wait_for_layer_load(name)
    worker.save_kv_layer(name, slot_mapping); worker.wait_for_save()
    sending, recving, failed = worker.finished(finished_req_ids)

`SchedulerCore` is the scheduler half the same way. The tensors may live on the CPU or on a
CUDA device: each is described by its data pointer, device index, shape, strides and dtype,
and the native module checks it against the negotiated layout. tests/gpu/driver.py drives
both halves as vLLM's GPU worker and scheduler call them.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch

from kvconnect import _kvconnect


def setup_json(*, kv_role: Optional[str], engine_id: str, extra_config: dict, hf_config: dict, block_size: int,
               cache_dtype: str, model_dtype: str, kv_device: str, kv_cache_layout: Optional[str],
               hma: bool = False, tp_size: int = 1, tp_rank: int = 0, opaque_blocks: Optional[str] = None) -> str:
    """The engine's settings as the native module negotiates from them (one JSON object)."""
    side = {
        "kv_role": kv_role,
        "engine_id": str(engine_id),
        "extra_config": dict(extra_config or {}),
        "hf_config": hf_config,
        "block_size": int(block_size),
        "cache_dtype": str(cache_dtype),
        "model_dtype": str(model_dtype).replace("torch.", ""),
        "hma": bool(hma),
        "tp_size": int(tp_size),
        "tp_rank": int(tp_rank),
        "kv_device": str(kv_device),
        "kv_cache_layout": kv_cache_layout,
        "opaque_blocks": opaque_blocks,
    }
    return json.dumps(side, default=str)


def required_kv_cache_layout(setup: str) -> Optional[str]:
    """The in-block layout the connector needs the engine to allocate (`"HND"`, `"NHD"`), or
    None where the engine may keep its own: negotiated from `setup` with its layout left open
    (nixl needs HND for more than one KV head per rank, as vLLM's NixlConnector asks; lmcache
    and flexkv prefer NHD; a composite takes its children's common answer). A setup that
    cannot be negotiated raises the same one-line error the worker would."""
    return _kvconnect.required_kv_cache_layout(setup)


def describe_tensor(name: str, layer: int, t: torch.Tensor) -> tuple:
    """One layer's KV cache tensor as the native worker takes it: (name, layer index, data
    pointer, shape, strides in elements, element size, dtype, device ordinal or None for
    host memory)."""
    if not isinstance(t, torch.Tensor):
        raise _kvconnect.KvconnectError(
            f"kvconnect: not implemented: the KV cache for layer '{name}' is a {type(t).__name__} "
            "(a state layer's tensors), not one tensor; kvconnect moves attention layers' KV only"
        )
    device = None if t.device.type == "cpu" else int(t.device.index or 0)
    return (name, int(layer), int(t.data_ptr()), [int(x) for x in t.shape], [int(x) for x in t.stride()],
            int(t.element_size()), str(t.dtype).replace("torch.", ""), device)


def slot_blocks(slot_mapping: torch.Tensor, block_size: int) -> list[int]:
    """The blocks a step's slot mapping writes (padding slots, -1, left out), ascending."""
    s = slot_mapping[slot_mapping >= 0]
    return [int(b) for b in torch.unique(torch.div(s, block_size, rounding_mode="floor")).tolist()]


class WorkerCore:
    """The worker half over a native `_kvconnect.Worker`: registration, the step's metadata,
    the per-layer and per-step calls, and the finished sets."""

    def __init__(self, setup: str, block_size: int):
        self.native = _kvconnect.Worker(setup)
        self._block_size = int(block_size)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_ids: dict[str, int] = {}
        self._save_blocks: tuple[int, list[int]] = (-1, [])

    def summary(self) -> str:
        return self.native.summary()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int],
                           num_blocks: Optional[int] = None) -> Optional[str]:
        """Describes and registers every layer's tensor (`layer_index` maps a layer's name to
        its index in the model). The tensors are kept here: the native worker addresses their
        memory directly. Returns the side channel's address on a producer."""
        self._kv_caches = dict(kv_caches)
        descs = []
        for name, t in self._kv_caches.items():
            if not isinstance(t, torch.Tensor):
                describe_tensor(name, 0, t)  # raises, naming the layer
            idx = int(layer_index(name))
            self._layer_ids[name] = idx
            descs.append(describe_tensor(name, idx, t))
        return self.native.register_kv_caches(descs, None if num_blocks is None else int(num_blocks))

    def bind_connector_metadata(self, data: bytes) -> None:
        self.native.bind_connector_meta(data)

    def clear_connector_metadata(self) -> None:
        self._save_blocks = (-1, [])

    def handle_preemptions(self, preempted) -> None:
        if preempted:
            self.native.handle_preemptions(list(preempted))

    def start_load_kv(self) -> None:
        self.native.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.native.wait_for_layer_load(self._layer_ids[layer_name])

    def save_kv_layer(self, layer_name: str, slot_mapping: Optional[torch.Tensor]) -> None:
        """Saves the blocks this step's `slot_mapping` writes in `layer_name`. The step's
        layers share one slot mapping object: its blocks are computed once per step."""
        if slot_mapping is None:
            return
        if self._save_blocks[0] != id(slot_mapping):
            self._save_blocks = (id(slot_mapping), slot_blocks(slot_mapping, self._block_size))
        self.native.save_kv_layer(self._layer_ids[layer_name], self._save_blocks[1])

    def wait_for_save(self) -> None:
        self.native.wait_for_save()

    def finished(self, finished_req_ids) -> tuple[set[str], set[str], dict[str, str]]:
        """(finished sending, finished receiving, failed receiving with why)."""
        sending, recving, failed = self.native.get_finished(sorted(finished_req_ids))
        return set(sending), set(recving), dict(failed)

    def block_ids_with_load_errors(self) -> set[int]:
        return set(self.native.block_ids_with_load_errors())

    def stats(self) -> dict[str, Any]:
        return json.loads(self.native.stats_json())

    def take_stats(self) -> dict[str, Any]:
        return json.loads(self.native.take_stats_json())

    def scheduler_socket(self) -> str:
        return self.native.scheduler_socket()

    def scheduler_matches_only_remote_prefills(self) -> bool:
        return bool(self.native.scheduler_matches_only_remote_prefills())

    def shutdown(self) -> None:
        self.native.shutdown()


class SchedulerCore:
    """The scheduler half over a native `_kvconnect.Scheduler`: requests as (id, prompt
    token ids, kv_transfer_params dict or None), blocks as one list per KV cache group."""

    def __init__(self, setup: str):
        self.native = _kvconnect.Scheduler(setup)
        self._step = 0

    def summary(self) -> str:
        return self.native.summary()

    def attach(self, sockets: list[str], matches_only_remote_prefills: bool = False) -> None:
        """The workers' scheduler halves, one socket per TP rank in rank order;
        `matches_only_remote_prefills`: every rank's half matches only decodes' requests, so
        the others are answered here (0 tokens) without a call."""
        self.native.attach(list(sockets), bool(matches_only_remote_prefills))

    def get_num_new_matched_tokens(self, req_id: str, prompt: list[int], params: Optional[dict],
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """External tokens to load (None: not known yet) and whether the load is asynchronous."""
        return self.native.get_num_new_matched_tokens(req_id, prompt, _params(params), int(num_computed_tokens))

    def update_state_after_alloc(self, req_id: str, prompt: list[int], params: Optional[dict],
                                 blocks: list[list[int]], num_external_tokens: int) -> None:
        self.native.update_state_after_alloc(req_id, prompt, _params(params), blocks, int(num_external_tokens))

    def build_connector_meta(self, scheduled: list[str], finished: list[str]) -> bytes:
        """The next step's metadata for the workers (the step is counted here)."""
        self._step += 1
        return self.native.build_connector_meta(self._step, list(scheduled), sorted(finished))

    def request_finished(self, req_id: str, prompt: list[int], params: Optional[dict],
                         blocks: list[list[int]]) -> tuple[bool, Optional[dict]]:
        """Whether the request's blocks stay held for a peer, and the params it returns."""
        delay, out = self.native.request_finished(req_id, prompt, _params(params), blocks)
        return bool(delay), (json.loads(out) if out is not None else None)


def _params(p: Optional[dict]) -> Optional[str]:
    return None if p is None else json.dumps(p)

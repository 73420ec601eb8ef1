"""kvconnect connectors as a vLLM (v1) KV connector.

    --kv-transfer-config '{"kv_connector": "KvconnectConnector",
                           "kv_connector_module_path": "kvconnect.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {
                               "kvconnect": {"kv_connector": "NixlConnector",
                                             "kv_connector_extra_config": {"backend": "tcp"}},
                               "side_channel_port": 5600}}'

`kvconnect` is a kvconnect kv-transfer-config exactly as kvconnect takes it (any built-in
or plugin connector); the other keys are the adapter's own (docs/vllm.md). Both halves
negotiate from vLLM's own settings at startup and refuse to start, with kvconnect's one-line
message, when vLLM's settings contradict the negotiation. Everything else is delegated to
the native module through the adapter's core (`kvconnect.core`, which runs without vLLM):
this file only turns vLLM's objects into plain values.
"""

from __future__ import annotations

import atexit
import ctypes
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm.logger import init_logger

from kvconnect import _kvconnect
from kvconnect.core import SchedulerCore, WorkerCore, required_kv_cache_layout, setup_json

# Under vLLM's logger, so its handlers and level apply.
logger = init_logger("vllm.kvconnect")

# vLLM's CPU attention backend keeps each head's K transposed inside a block (and its
# layout may change with the ISA): kvconnect moves such blocks whole and never adapts them.
_CPU_OPAQUE = "vLLM's CPU attention backend stores K transposed inside a block"


@dataclass
class KvconnectMetadata(KVConnectorMetadata):
    """One step's metadata: bytes the scheduler half made for the worker half, and the
    requests vLLM preempted this step (for `handle_preemptions`; usually none)."""

    data: bytes
    preempted: tuple[str, ...] = ()
    # The step schedules no tokens: the engine steps only because requests wait on the
    # connector (blocks held for decode, loads in flight).
    idle: bool = False


@dataclass
class KvconnectHandshake(KVConnectorHandshakeMetadata):
    """What each worker hands vLLM's scheduler process at startup: where it serves its TP
    rank's half of the kvconnect connector's scheduler. Both halves run in the worker process,
    as in kvconnect's own workers, so a cache connector's halves share its store; each rank
    has its own connector, and the scheduler asks every rank's half and combines them.
    `matches_only_remote_prefills`: the half matches only decodes' requests (a transport), so
    the scheduler answers the others itself, without a call."""

    scheduler_socket: str
    matches_only_remote_prefills: bool = False


@dataclass
class KvconnectStats(KVConnectorStats):
    """kvconnect's counters for one interval, as the worker's native half reports them:
    `loads_done`, `loads_failed`, `sends_done`, `sends_expired`, `handshakes`, `handshakes_refused`,
    `external_requests`, `external_tokens`, `loads_by_source_<source>` (`peer` or
    `<connector>_<tier>`) and `cache_tokens_<connector>_<tier>`; the adapter's own
    `idle_steps_paced` and `idle_wait_seconds`; and the scheduler's `loads_preempted`,
    `loads_refused_tp` and `matches_answered_here`. Every value is a count (or seconds), so
    workers' and intervals' stats add up."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvconnectStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kvconnect_{k}": v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# Counters shown on vLLM's /metrics: (stats key, metric name, help).
_PROM_COUNTERS = [
    ("loads_done", "vllm:kvconnect_loads_done",
     "Requests whose external KV kvconnect finished loading, from a prefill engine or a cache tier."),
    ("loads_failed", "vllm:kvconnect_loads_failed", "Requests whose external KV load failed."),
    ("sends_done", "vllm:kvconnect_sends_done", "Requests whose KV a peer finished reading from this engine."),
    ("sends_expired", "vllm:kvconnect_sends_expired",
     "Requests whose KV this engine held for a peer until the lease ended, none having finished reading it "
     "(decode never pulled it, or its done was lost); the blocks were freed then."),
    ("loads_preempted", "vllm:kvconnect_loads_preempted",
     "Requests vLLM preempted after they loaded external KV (the loaded KV is dropped and recomputed or loaded again)."),
    ("loads_refused_tp", "vllm:kvconnect_loads_refused_tp",
     "Requests computed here instead of loaded because their producer ran at a tensor-parallel size that does not divide this server's."),
    ("matches_answered_here", "vllm:kvconnect_matches_answered_here",
     "Requests matched by the scheduler itself, 0 external tokens without a round trip to the worker processes: "
     "not a decode's, where every rank's connector matches only remote prefills (a transport alone)."),
    ("handshakes", "vllm:kvconnect_handshakes", "Side-channel handshakes with prefill engines."),
    ("handshakes_refused", "vllm:kvconnect_handshakes_refused", "Handshakes refused (descriptors differ, wrong engine)."),
    ("external_requests", "vllm:kvconnect_external_requests", "Requests scheduled to load KV from outside."),
    ("external_tokens", "vllm:kvconnect_external_tokens", "Prompt tokens scheduled to load instead of computing."),
    ("idle_steps_paced", "vllm:kvconnect_idle_steps_paced",
     "Worker steps that had nothing to do and waited before returning (idle_step_wait_ms)."),
    ("idle_wait_seconds", "vllm:kvconnect_idle_wait_seconds",
     "Seconds the worker's idle steps waited (idle_step_wait_ms), leaving the cores to the server's other processes."),
]


# Counters with a `source` label: (stats key prefix, metric name, help).
_PROM_SOURCE_COUNTERS = [
    ("cache_tokens_", "vllm:kvconnect_cache_tokens", "Prompt tokens each kvconnect cache tier supplied."),
    ("loads_by_source_", "vllm:kvconnect_loads_by_source",
     "Requests each source supplied external KV to: peer (a prefill engine) or a cache tier."),
]


class KvconnectPromMetrics(KVConnectorPromMetrics):
    """kvconnect's counters as Prometheus counters on vLLM's /metrics; the tokens each cache
    tier supplied as `vllm:kvconnect_cache_tokens{source="<connector>_<tier>"}` and the loads
    each source served as `vllm:kvconnect_loads_by_source{source="peer"|"<connector>_<tier>"}`."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters = {}
        for key, name, doc in _PROM_COUNTERS:
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = create_metric_per_engine(c, per_engine_labelvalues)
        self._by_source = [
            (prefix, self._counter_cls(name=name, documentation=doc, labelnames=labelnames + ["source"]))
            for prefix, name, doc in _PROM_SOURCE_COUNTERS
        ]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, v in (transfer_stats_data or {}).items():
            if not v:
                continue
            if k in self._counters:
                self._counters[k][engine_idx].inc(v)
                continue
            for prefix, counter in self._by_source:
                if k.startswith(prefix):
                    counter.labels(*self.per_engine_labelvalues[engine_idx], k[len(prefix):]).inc(v)


def _layer_index(name: str) -> int:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except Exception:  # older or newer vLLM: the first number in the name
        m = re.search(r"\.(\d+)\.", name)
        if m is None:
            raise _kvconnect.KvconnectError(
                f"kvconnect: cannot tell the layer index of KV cache tensor '{name}'"
            )
        return int(m.group(1))


def _kv_cache_layout(vllm_config, platform) -> Optional[str]:
    if platform.is_cpu():
        return "HND"  # vLLM's CPU backend logs "Using LBHNC KV cache layout"
    # vLLM 0.32 resolves one layout in the engine core before any connector is created and
    # records its name (`LBHNC`, ...) here; earlier versions answer get_kv_cache_layout().
    resolved = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if resolved:
        return str(getattr(resolved, "name", resolved))
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return str(get_kv_cache_layout())
    except Exception:
        return None


def _allow_amx() -> None:
    """Asks Linux for this process's permission to use AMX tiles (`arch_prctl(ARCH_REQ_XCOMP_PERM)`,
    through torch), on a CPU that has them. Without it the first AMX instruction is an illegal
    one (SIGILL). vLLM's CPU attention (bfloat16, block size a multiple of 32) runs AMX kernels
    for a prompt that continues from KV already in the cache, which vLLM alone does not meet
    before something else asked; a decode whose first request loads its prompt meets it in its
    first forward pass, and vLLM's worker died of `Fatal Python error: Illegal instruction` in
    `cpu_attention_with_kv_cache` (Intel Xeon with AMX, whole-block and in-block loads alike)."""
    try:
        if torch.cpu._is_amx_tile_supported() and not torch._C._cpu._init_amx():
            logger.warning("kvconnect worker: Linux refused this process AMX tiles; vLLM's CPU attention may "
                           "die of an illegal instruction")
    except AttributeError:  # a torch without these calls
        pass


def _setup_json(vllm_config, tp_rank: int, open_layout: bool = False) -> str:
    """vLLM's settings, as the native module negotiates from them; with `open_layout` the KV
    cache layout is left for negotiation to pick (what the connector would ask vLLM for)."""
    from vllm.platforms import current_platform

    kt = vllm_config.kv_transfer_config
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    sc = vllm_config.scheduler_config
    return setup_json(
        kv_role=kt.kv_role,
        engine_id=str(kt.engine_id),
        extra_config=dict(kt.kv_connector_extra_config or {}),
        hf_config=mc.hf_config.to_dict(),
        block_size=int(cc.block_size),
        cache_dtype=str(cc.cache_dtype),
        model_dtype=str(mc.dtype),
        hma=not bool(getattr(sc, "disable_hybrid_kv_cache_manager", True)),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        tp_rank=tp_rank,
        kv_device=str(current_platform.device_type),
        kv_cache_layout=None if open_layout else _kv_cache_layout(vllm_config, current_platform),
        opaque_blocks=_CPU_OPAQUE if current_platform.is_cpu() else None,
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # the scheduler process has no TP group
        return 0


def _params(request) -> Optional[dict]:
    return getattr(request, "kv_transfer_params", None)


def _block_lists(blocks) -> list[list[int]]:
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    if ids and isinstance(ids[0], int):
        return [list(ids)]
    return [list(g) for g in ids]


class _SharedKvAllocation(TorchFunctionMode):
    """Inside vLLM's KV cache allocation: the one `torch.zeros(size, dtype=int8)` vLLM
    allocates its whole KV cache with returns the native worker's shared-memory buffer
    (zeroed, each layer's blocks one segment); every other call runs as it would."""

    def __init__(self, worker, size: int, placements):
        super().__init__()
        self._worker = worker
        self._size = size
        self._placements = placements
        self._done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.zeros and not self._done and len(args) == 1 and _as_int(args[0]) == self._size
                and kwargs.get("dtype") == torch.int8 and torch.device(kwargs.get("device") or "cpu").type == "cpu"):
            addr, names = self._worker.allocate_shared_kv(self._size, self._placements)
            self._done = True
            _unlink_when_gone(names)
            memory = (ctypes.c_int8 * self._size).from_address(addr)
            return torch.frombuffer(memory, dtype=torch.int8)
        return func(*args, **kwargs)


def _unlink_when_gone(names: list[str]) -> None:
    """The KV segments' names go with this process: at interpreter exit, or, since vLLM
    SIGKILLs its workers on shutdown, through multiprocessing's resource tracker, which
    unlinks registered shared memory once the processes using it are gone."""
    from multiprocessing import resource_tracker

    for n in names:
        resource_tracker.register(n, "shared_memory")

    def at_exit():
        _kvconnect.unlink_shared_kv()
        for n in names:
            resource_tracker.unregister(n, "shared_memory")

    atexit.register(at_exit)


def _as_int(x) -> Optional[int]:
    if isinstance(x, (tuple, list, torch.Size)) and len(x) == 1:
        x = x[0]
    return x if isinstance(x, int) else None


class KvconnectConnector(KVConnectorBase_V1):
    """A kvconnect connector behind vLLM's KV connector API (see the module's doc)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._scheduler = None
        self._worker = None
        self._core: Optional[WorkerCore] = None
        self._sched: Optional[SchedulerCore] = None
        # Scheduler: requests that loaded external KV, until they finish; and how many of
        # them vLLM preempted since the stats were last taken.
        self._loaded: set[str] = set()
        self._preempted_loads = 0
        ev = getattr(vllm_config, "kv_events_config", None)
        self._events_on = bool(ev is not None and getattr(ev, "enable_kv_cache_events", False))
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerCore(_setup_json(vllm_config, 0))
            self._scheduler = self._sched.native
            summary = self._scheduler.summary()
        else:
            _allow_amx()
            self._core = WorkerCore(_setup_json(vllm_config, _tp_rank()), self._block_size)
            self._worker = self._core.native
            self._idle_wait_max = self._worker.idle_step_wait_s()
            summary = self._worker.summary()
        logger.info("kvconnect %s: %s", "scheduler" if self._scheduler else "worker", summary)
        if getattr(_kvconnect, "BUILD", "release") == "debug" and self._scheduler:
            logger.warning("kvconnect: this is a debug build of kvconnect's native module (maturin's --profile dev), "
                           "whose calls on every request cost several times a release build's; for serving and "
                           "for timings, install the release build: pip install ./python")

    # ---- worker side ----

    def get_mem_pool_context(self):
        """Over the nixl `shm` backend a producer's KV cache must be shared memory, so a
        same-host decode can map it: vLLM allocates its whole KV cache with one
        `torch.zeros` inside this context, and that call gets kvconnect's shared-memory
        buffer instead (docs/vllm.md)."""
        if self._worker is None or not self._worker.kv_in_shared_memory():
            return None
        cfg = self._kv_cache_config
        tensors = list(getattr(cfg, "kv_cache_tensors", None) or [])
        if not tensors:
            raise _kvconnect.KvconnectError(
                "kvconnect: not implemented: the nixl backend 'shm' with a vLLM that passes the connector no "
                "KV cache placement (kv_cache_config.kv_cache_tensors); use backend 'tcp'"
            )
        placements = [
            (int(t.offset), int(t.layer_stride), int(t.block_stride), len(t.layers), int(cfg.num_blocks_of(t)))
            for t in tensors
        ]
        return _SharedKvAllocation(self._worker, int(tensors[0].size), placements)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        addr = self._core.register_kv_caches(kv_caches, _layer_index, num_blocks)
        if addr is not None:
            logger.info("kvconnect worker: side channel listening on %s", addr)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._core.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._core.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        if attn_metadata is None:
            return
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata.get(layer_name)
        self._core.save_kv_layer(layer_name, getattr(attn_metadata, "slot_mapping", None))

    def wait_for_save(self):
        self._core.wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        """vLLM frees the preempted requests' blocks before this step's forward: the
        connector finishes or drops its background work on them first (flexkv waits for
        their saves in flight). Nothing to do, and no call, in a step without preemptions."""
        self._core.handle_preemptions(getattr(kv_connector_metadata, "preempted", ()))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._idle_step = getattr(connector_metadata, "idle", False)
        self._core.bind_connector_metadata(connector_metadata.data)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._core.clear_connector_metadata()

    # With one KV cache group a failed load is reported by its blocks (vLLM recomputes from
    # the first bad one); with several, block ids are not unique, so by request instead.
    _failed_by_request = False

    # Idle steps: vLLM steps without pause while any request waits on the connector (a
    # producer's blocks held until decode has pulled them, a load in flight), each step a
    # round trip between engine core and worker that does nothing, on the cores the server's
    # other processes need. An idle step that finished nothing waits before it returns, twice
    # as long each time from IDLE_WAIT_MIN seconds up to `idle_step_wait_ms`; a step with work
    # or news starts again from none.
    IDLE_WAIT_MIN = 0.0001
    _idle_step = False
    _idle_wait = 0.0
    _idle_wait_max = 0.0
    # Since the stats were last taken: idle steps that waited, and the seconds they waited.
    _idle_paced = 0
    _idle_waited = 0.0

    def _pace_idle(self, news: bool) -> None:
        if news or not self._idle_step or self._idle_wait_max <= 0:
            self._idle_wait = 0.0
            return
        self._idle_wait = min(max(self._idle_wait * 2, self.IDLE_WAIT_MIN), self._idle_wait_max)
        time.sleep(self._idle_wait)
        self._idle_paced += 1
        self._idle_waited += self._idle_wait

    def _finished(self, finished_req_ids: set[str]):
        sending, recving, failed = self._core.finished(finished_req_ids)
        self._pace_idle(bool(sending or recving or failed or finished_req_ids))
        for r in sorted(recving):
            logger.info("kvconnect worker: request %s loaded its external KV", r)
        for r, why in sorted(failed.items()):
            logger.warning("kvconnect worker: request %s failed to load its external KV: %s", r, why)
        return sending, recving, set(failed)

    def get_finished(self, finished_req_ids: set[str]):
        sending, recving, failed = self._finished(finished_req_ids)
        # A failed load is finished too: vLLM then applies kv_load_failure_policy.
        recving |= failed
        return (sending or None, recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving | failed,
            failed_recving=failed if self._failed_by_request else set(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks = self._core.block_ids_with_load_errors()
        return set() if self._failed_by_request else blocks

    def kvconnect_stats(self) -> dict[str, Any]:
        """The native worker's counters since start (see KvconnectStats)."""
        return self._core.stats()

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        if self._worker is None:
            return None
        return KvconnectHandshake(scheduler_socket=self._worker.scheduler_socket(),
                                  matches_only_remote_prefills=self._worker.scheduler_matches_only_remote_prefills())

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._worker is None:
            # The scheduler's own counts: preempted requests that had loaded external KV, loads
            # refused for their producer's TP size, matches answered without the workers.
            n, self._preempted_loads = self._preempted_loads, 0
            data = {"loads_preempted": n, "loads_refused_tp": self._scheduler.take_refused_loads(),
                    "matches_answered_here": self._scheduler.take_matches_answered_here()}
            data = {k: v for k, v in data.items() if v}
            return KvconnectStats(data=data) if data else None
        delta = self._core.take_stats() or {}
        if self._idle_paced:
            delta["idle_steps_paced"], delta["idle_wait_seconds"] = self._idle_paced, self._idle_waited
            self._idle_paced, self._idle_waited = 0, 0.0
        return KvconnectStats(data=delta) if delta else None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        """The layout vLLM allocates its GPU KV cache in: the one the kvconnect connector needs
        (nixl: HND, as vLLM's NixlConnector asks; lmcache, flexkv: NHD), negotiated natively.
        None on vLLM's CPU backend, whose in-block layout is its own, for one KV head per rank
        (MLA), and where the connector needs none. VLLM_KV_CACHE_LAYOUT still wins; a layout
        the connector cannot take is then refused at startup with the remedy."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu() or getattr(vllm_config, "model_config", None) is None:
            return None
        if getattr(vllm_config, "kv_transfer_config", None) is None:
            return None
        try:
            layout = required_kv_cache_layout(_setup_json(vllm_config, 0, open_layout=True))
        except _kvconnect.KvconnectError as e:
            logger.warning("kvconnect: cannot tell which KV cache layout the connector needs, so vLLM "
                           "keeps its own; the connector's setup will say why: %s", e)
            return None
        if layout is not None:
            logger.info("kvconnect: asking vLLM for the %s KV cache layout, which the connector needs", layout)
        return layout

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return KvconnectStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvconnectPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._core is not None:
            self._core.shutdown()

    # ---- scheduler side ----

    def set_xfer_handshake_metadata(self, metadata) -> None:
        if self._scheduler is None:
            return
        by_rank = {int(r): m for r, m in (metadata or {}).items() if isinstance(m, KvconnectHandshake)}
        tp = int(self._vllm_config.parallel_config.tensor_parallel_size)
        missing = [r for r in range(tp) if r not in by_rank]
        if missing:
            raise _kvconnect.KvconnectError(
                f"kvconnect: vLLM's workers of TP rank(s) {missing} (of {tp}) serve no kvconnect scheduler half; "
                "run the same kvconnect in vLLM's scheduler and every worker"
            )
        sockets = [by_rank[r].scheduler_socket for r in range(tp)]
        local = all(by_rank[r].matches_only_remote_prefills for r in range(tp))
        self._sched.attach(sockets, local)
        logger.info("kvconnect scheduler: the connector's scheduler halves run in the workers, at %s%s", ", ".join(sockets),
                    "; requests that are not decodes' match nothing, answered here" if local else "")

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        # Every token the connector has, up to the prompt's last (which vLLM computes to sample
        # the first token), also where that ends inside a block.
        return self._sched.get_num_new_matched_tokens(
            request.request_id, list(request.prompt_token_ids or []), _params(request), int(num_computed_tokens)
        )

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._sched.update_state_after_alloc(
            request.request_id,
            list(request.prompt_token_ids or []),
            _params(request),
            _block_lists(blocks),
            int(num_external_tokens),
        )
        if num_external_tokens > 0:
            self._loaded.add(request.request_id)
            logger.info(
                "kvconnect scheduler: request %s loads %d external tokens", request.request_id, num_external_tokens
            )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            scheduled += list(getattr(cached, "req_ids", []))
        finished = sorted(getattr(scheduler_output, "finished_req_ids", set()) or set())
        data = self._sched.build_connector_meta(scheduled, finished)
        idle = not scheduled and not finished and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if not preempted:
            return KvconnectMetadata(data=data, idle=idle)
        for r in sorted(preempted):
            if r in self._loaded:
                self._loaded.discard(r)
                self._preempted_loads += 1
                logger.info("kvconnect scheduler: request %s preempted after loading external KV; "
                            "its blocks are freed and its prompt is recomputed or loaded again", r)
        return KvconnectMetadata(data=data, preempted=tuple(sorted(preempted)))

    def reset_cache(self) -> Optional[bool]:
        """vLLM's `POST /reset_prefix_cache?reset_external=true`: every rank's connector
        empties its store (lmcache's and flexkv's tiers; a connector without a store has
        nothing to reset). False while a transfer holds stored blocks: vLLM answers
        `{"success": false}` and the caller may retry."""
        ok = bool(self._scheduler.reset_cache())
        logger.info("kvconnect scheduler: reset_cache: %s", "store emptied" if ok else "refused now, retry later")
        return ok

    def take_events(self):
        """The connector's KV events as vLLM's BlockStored (hashes, parent, token ids, block
        size, medium: `cpu_tier`, `disk`, `remote`), BlockRemoved and AllBlocksCleared, so
        vLLM's own `--kv-events-config` publisher carries them. Asked only when vLLM publishes
        KV events, so a server without them pays no call per step. The workers' side
        (`get_kv_connector_kv_cache_events`) stays None: the same events come from here."""
        if not self._events_on:
            return ()
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        out = []
        for kind, hashes, parent, tokens, block_size, medium in self._scheduler.take_events():
            if kind == "stored":
                out.append(BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                                       block_size=block_size, lora_id=None, medium=medium, lora_name=None))
            elif kind == "removed":
                out.append(BlockRemoved(block_hashes=list(hashes), medium=medium))
            else:
                out.append(AllBlocksCleared())
        return out

    def request_finished(self, request, block_ids):
        self._loaded.discard(request.request_id)
        return self._sched.request_finished(
            request.request_id, list(request.prompt_token_ids or []), _params(request), _block_lists(block_ids)
        )


class KvconnectHmaConnector(KvconnectConnector, SupportsHMA):
    """KvconnectConnector for a kvconnect connector that supports vLLM's hybrid KV cache
    manager (nixl does; lmcache, flexkv and a composite holding either do not). vLLM keeps
    HMA on for it, so each KV cache group keeps its own block table; the negotiation then runs
    with HMA on and refuses, at startup and naming the child, a connector that lacks it.
    A failed load is reported by request (block ids are per group)."""

    _failed_by_request = True

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        return self.request_finished(request, block_ids)

//! The nixl connector's backends: how a worker registers its KV regions, what a producer
//! publishes for its consumers, and how a consumer moves a request's blocks.
//!
//! Each backend is one file here with a [`BackendInfo`] (its name, what it can do, how to
//! start it) and a [`Transport`] (the started backend of one worker); [`BACKENDS`] lists
//! them. Everything else (config, capabilities, the worker, the puller) asks the table or the
//! trait, never a backend by name, so adding a backend is a file plus its line in
//! [`BACKENDS`]. The producer's listener, the lease and the control messages (`hold`,
//! `pin`, `done`) are the same for every backend ([`crate::producer`]). The puller sends
//! them ([`crate::puller::Puller::pull`]); a backend only says which go around its copy
//! ([`PullSteps`]) and moves the bytes ([`Transport::copy`]).

pub mod cuda_ipc;
pub mod nixl;
pub mod shm;
pub mod tcp;

use crate::config::{NixlConfig, NAME};
use crate::copy_plan::CopyPlan;
use crate::error::TransferError;
use crate::metadata::{LoadSpec, PeerInfo, PeerKey, ProducerMetadata};
use crate::puller::PullStats;
pub use crate::puller::Streams;
use kvconnect_api::geometry::Geometry;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    ConnectorContext, ConnectorError, ConnectorResult, KvRegion, LayerId, MemoryKind, RequestId,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Every backend; the first is the default. A new backend is a file in this folder and one
/// line here.
static BACKENDS: [&BackendInfo; 4] = [&shm::BACKEND, &tcp::BACKEND, &nixl::BACKEND, &cuda_ipc::BACKEND];

/// What one backend is and can do, and how a worker starts it.
#[derive(Debug)]
pub struct BackendInfo {
    /// The name users write (`kv_connector_extra_config.backend`).
    pub name: &'static str,
    /// Other names accepted for it (lowercase).
    pub aliases: &'static [&'static str],
    /// How the unknown-backend message offers it (`"shm" (same host)`).
    pub offer: &'static str,
    /// Moves KV between engines of different tensor-parallel sizes (each rank's head slices),
    /// and registers the regions of several ranks in one worker.
    pub across_tp: bool,
    /// Moves each request's per-request state (state-space layers) with its KV.
    pub carries_state: bool,
    /// The memory its data path reads and writes (what the connector declares for it).
    pub memory_kinds: &'static [MemoryKind],
    /// The producer's listener serves `read` (the blocks travel over it).
    pub serves_reads: bool,
    /// The producer's KV regions must be POSIX shared-memory segments (the host allocates its
    /// pool so).
    pub shm_regions: bool,
    /// Whether this build and machine can run it; `Err` says why and what to do.
    pub available: fn() -> Result<(), ConnectorError>,
    /// Starts it over a worker's registered regions.
    pub start: fn(&Setup<'_>) -> ConnectorResult<Started>,
}

/// A backend, as the config names it: a handle to its [`BackendInfo`].
#[derive(Clone, Copy)]
pub struct Backend(&'static BackendInfo);

impl PartialEq for Backend {
    fn eq(&self, other: &Backend) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Backend {}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({})", self.0.name)
    }
}

impl Default for Backend {
    fn default() -> Backend {
        Backend(BACKENDS[0])
    }
}

impl std::ops::Deref for Backend {
    type Target = BackendInfo;
    fn deref(&self) -> &BackendInfo {
        self.0
    }
}

impl Backend {
    /// The backend `info` describes (each backend's file names its own).
    pub fn of(info: &'static BackendInfo) -> Backend {
        Backend(info)
    }

    /// Every backend, the default first.
    pub fn all() -> impl Iterator<Item = Backend> {
        BACKENDS.iter().map(|b| Backend(b))
    }

    /// The name users write.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// Parses a backend name (or an alias, any case).
    pub fn parse(s: &str) -> Result<Backend, ConnectorError> {
        let want = s.trim().to_ascii_lowercase();
        if let Some(b) = Backend::all().find(|b| b.name == want || b.aliases.contains(&want.as_str())) {
            return Ok(b);
        }
        let offers: Vec<&str> = BACKENDS.iter().map(|b| b.offer).collect();
        let offers = match offers.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => offers.join(", "),
        };
        Err(ConnectorError::config(
            NAME,
            format!("unknown backend '{want}' in kv_connector_extra_config.backend; use {offers}"),
        ))
    }

    /// The backends with `what`, named for messages ("shm and tcp").
    pub fn names_where(what: impl Fn(&BackendInfo) -> bool) -> String {
        let names: Vec<&str> = BACKENDS.iter().filter(|b| what(b)).map(|b| b.name).collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => names.join(", "),
        }
    }
}

/// What starting a backend is given.
#[derive(Debug)]
pub struct Setup<'a> {
    /// The worker's regions, as the host registered them.
    pub regions: &'a [KvRegion],
    /// The worker's context (model, effective layout, engine id).
    pub ctx: &'a ConnectorContext,
    /// The connector's settings.
    pub cfg: &'a NixlConfig,
    /// Tensor-parallel ranks whose regions `regions` holds.
    pub tp_ranks: u32,
    /// The worker produces KV (publishes it to consumers).
    pub producer: bool,
    /// The worker consumes KV (pulls it).
    pub consumer: bool,
}

/// A started backend: the checked view of the regions, and the backend itself.
pub struct Started {
    /// The regions, addressed through the effective layout.
    pub mem: KvMemory,
    /// The backend of this worker.
    pub transport: Arc<dyn Transport>,
}

/// The regions of backends that read and write host memory (`shm`, `tcp`): host memory, of
/// every tensor-parallel rank the worker registered. A worker holding one rank of an engine
/// at TP > 1 (vLLM's workers) addresses it as that rank of its engine, so loads between
/// TP sizes plan head slices.
pub(crate) fn host_memory(s: &Setup<'_>) -> ConnectorResult<KvMemory> {
    // Valid until the worker is dropped (`KvRegion::new`); shutdown stops the listener and
    // joins the pull thread, the other users of the memory, before that.
    let mem = KvMemory::with_tp_ranks(s.regions, &s.ctx.model, &s.ctx.effective, s.tp_ranks)
        .map_err(|e| ConnectorError::invalid(NAME, format!("cannot register KV regions: {e}")))?
        .with_opaque_heads_outer(s.cfg.opaque_heads_outer);
    if s.tp_ranks != 1 || s.ctx.tp_size <= 1 {
        return Ok(mem);
    }
    mem.as_rank_of(s.ctx.tp_rank, s.ctx.tp_size).ok_or_else(|| {
        ConnectorError::invalid(
            NAME,
            format!("tp_rank {} is not below tp_size {}", s.ctx.tp_rank, s.ctx.tp_size),
        )
    })
}

/// A consumer's completion of a request that reached the producer outside its listener (a
/// NIXL notification).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Who sent it, for messages.
    pub from: String,
    /// The request.
    pub request: RequestId,
    /// The capability it names.
    pub capability: String,
}

/// What the puller sends the producer before a backend's copy, so that the copy reads blocks
/// the producer holds for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// `hold`: the request is held, its lease renewed (nixl, whose READ may take long).
    Hold,
    /// `pin` naming the blocks read, sent as the copy starts and answered while it runs (shm,
    /// cuda_ipc, which read the producer's memory without it seeing the reads): the request is
    /// held, the blocks are its own, and the hold lasts at least the answer's `ms`. A copy
    /// that ends within it read the request's blocks throughout; one that does not is pinned
    /// again after it.
    Overlapped,
    /// Nothing: the producer checks each read itself (tcp).
    Nothing,
}

/// What the puller sends the producer after a backend's copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirm {
    /// `done` (`DoneBy` for one of several readers), waited for: `Ok` means the request was
    /// still held, so the bytes copied are its own; the producer may free the blocks.
    Done,
    /// `done` without waiting for its answer, after a pin that already proved the copy whole
    /// ([`Pin::Overlapped`]).
    Release,
    /// `hold`: the backend then tells the producer itself ([`Transport::confirmed`]).
    Hold,
}

/// The steps of one pull around a backend's copy, which the puller takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullSteps {
    /// The puller plans the copy ([`CopyPlan::build`]) before any message, so a load this
    /// engine cannot take fails without one; `false`: the backend's own gather checks the
    /// load in its copy.
    pub plan: bool,
    /// Sent before the copy.
    pub before: Pin,
    /// Sent after it.
    pub after: Confirm,
}

/// The copy's plan, which the puller builds for a backend whose steps ask for one.
pub(crate) fn planned(plan: Option<&CopyPlan>) -> Result<&CopyPlan, TransferError> {
    plan.ok_or_else(|| {
        TransferError::Plan("the puller built no copy plan for a backend that copies by one".into())
    })
}

/// The puller's messages while a backend copies ([`Transport::copy_overlapped`]).
pub trait WhileCopying {
    /// Sends the pin: called once the copy is under way.
    fn started(&mut self) -> Result<(), TransferError>;

    /// Reads the pin's answer (its outcome is kept for the puller). A backend whose copy runs
    /// without the calling thread (a GPU kernel) calls it after `started` and before it
    /// waits for the copy: the answer arrives while the copy runs, and reading it then costs
    /// the load nothing after the copy. Without this call the puller reads it after the copy.
    fn answer(&mut self);
}

/// [`WhileCopying`] with no pin: a copy outside a pull (tests, benchmarks).
pub struct NoPin;

impl WhileCopying for NoPin {
    fn started(&mut self) -> Result<(), TransferError> {
        Ok(())
    }

    fn answer(&mut self) {}
}

/// One worker's started backend. Shared by the worker (handshakes, notifications) and its
/// pull thread (pulls), so every method takes `&self`.
pub trait Transport: Send + Sync {
    /// Which backend this is.
    fn backend(&self) -> Backend;

    /// Adds what this backend's consumers need to a producer's handshake metadata.
    fn publish(&self, _meta: &mut ProducerMetadata) -> ConnectorResult<()> {
        Ok(())
    }

    /// Checks (and for NIXL loads) a producer before any load from it; `known` are the peers
    /// handshaken before, by what names them.
    fn admit(
        &self,
        _peer: &PeerInfo,
        _own: &Geometry,
        _known: &HashMap<PeerKey, Arc<PeerInfo>>,
    ) -> ConnectorResult<()> {
        Ok(())
    }

    /// Completions consumers sent since the last call outside the listener.
    fn completions(&self) -> ConnectorResult<Vec<Completion>> {
        Ok(Vec::new())
    }

    /// The steps the puller takes around this backend's copy.
    fn steps(&self) -> PullSteps;

    /// Moves `load` from `peer` into `local`, after the puller pinned the blocks and before
    /// it confirms them ([`Transport::steps`]); the control messages are the puller's, never a
    /// backend's. `conns`: the connections to the producer, for a backend whose blocks
    /// travel over them (`serves_reads`: tcp), `None` for the others. `plan`: the copy's
    /// runs, when its steps ask the puller to plan (a backend with its own gather does not pay
    /// for a plan). On `Ok` the bytes are in place.
    fn copy(
        &self,
        conns: Option<&mut Streams<'_>>,
        local: &KvMemory,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: Option<&CopyPlan>,
    ) -> Result<PullStats, TransferError>;

    /// [`Transport::copy`] for a backend whose steps pin while it copies ([`Pin::Overlapped`]):
    /// calls `pin.started()` (which sends the pin) once the copy is under way, and returns only
    /// once the copy is over, whatever `started` returned. By default `started` goes first,
    /// then the copy; a backend that copies asynchronously (a GPU kernel) calls it after its
    /// launch, so the pin's sending overlaps the copy too, and then `pin.answer()` before it
    /// waits for the copy.
    fn copy_overlapped(
        &self,
        local: &KvMemory,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: Option<&CopyPlan>,
        pin: &mut dyn WhileCopying,
    ) -> Result<PullStats, TransferError> {
        pin.started()?;
        self.copy(None, local, groups, peer, load, plan)
    }

    /// Starts `load`'s copy now, on the calling thread (the step's, in `start_load_kv`), for
    /// a backend whose copy runs asynchronously and can start without waiting (a GPU gather
    /// over a producer's regions opened already): the pull thread's [`Transport::copy_overlapped`]
    /// of it then sends the pin and waits, so neither the hand-off to the pull thread nor its
    /// wake-up delays the copy. `Ok(false)` (the default): not started, the pull thread copies
    /// it. Whatever then happens to the load, the pull thread calls
    /// [`Transport::settle_launched`] before it reports it.
    fn launch(
        &self,
        _local: &KvMemory,
        _groups: &[Vec<LayerId>],
        _peer: &PeerInfo,
        _load: &LoadSpec,
    ) -> Result<bool, TransferError> {
        Ok(false)
    }

    /// Waits for a copy [`Transport::launch`] started, if one still runs (idempotent): after
    /// it, no copy of a load that is reported writes into this worker's blocks.
    fn settle_launched(&self) {}

    /// Tells the producer it is done with `load`, its own way, after the puller confirmed
    /// the blocks (NIXL's notification after a `hold`); nothing by default (`done` told it).
    fn confirmed(&self, _peer: &PeerInfo, _load: &LoadSpec) -> Result<(), TransferError> {
        Ok(())
    }

    /// Forgets what it keeps for producer `key` (after a transfer error from it): the next
    /// pull starts again from its handshake.
    fn forget(&self, _key: &PeerKey) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_parse_and_unknown_ones_list_every_backend() {
        for b in Backend::all() {
            assert_eq!(Backend::parse(&b.name.to_ascii_uppercase()).unwrap(), b);
            for a in b.aliases {
                assert_eq!(Backend::parse(a).unwrap(), b);
            }
        }
        assert_eq!(Backend::parse("UCX").unwrap().name(), "nixl");
        assert_eq!(Backend::default().name(), "shm");
        let e = Backend::parse("rdma").unwrap_err().to_string();
        assert!(
            e.ends_with(
                "unknown backend 'rdma' in kv_connector_extra_config.backend; use \"shm\" (same host), \
                 \"tcp\" (any hosts), \"nixl\" or \"cuda_ipc\" (same host, GPU KV)"
            ),
            "{e}"
        );
        assert_eq!(Backend::names_where(|b| b.across_tp), "shm and tcp");
    }
}

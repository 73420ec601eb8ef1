//! Backend `shm`: one host. The producer's KV regions are POSIX shared-memory segments
//! ([`kvconnect_dataplane::shm`]). The consumer maps its segments read-only (once per
//! producer, again when they change) and copies the coalesced runs straight into its own
//! blocks (large pulls on several threads), while the puller's `pin` (sent as the copy
//! starts) is answered; then the puller sends `done` ([`super::Pin::Overlapped`]).

use super::{host_memory, planned, BackendInfo, Confirm, Pin, PullSteps, Setup, Started, Streams, Transport};
use crate::copy_plan::{CopyPlan, LocalRegions};
use crate::error::TransferError;
use crate::metadata::{LoadSpec, PeerInfo, PeerKey};
use crate::puller::PullStats;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{ConnectorResult, LayerId, MemoryKind};
use kvconnect_dataplane::shm::ShmMapping;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Its entry in [`super::BACKENDS`].
pub static BACKEND: BackendInfo = BackendInfo {
    name: "shm",
    aliases: &[],
    offer: "\"shm\" (same host)",
    across_tp: true,
    carries_state: true,
    // Its copies read and write host memory only.
    memory_kinds: &[MemoryKind::Host],
    serves_reads: false,
    shm_regions: true,
    available: || Ok(()),
    start,
};

fn start(s: &Setup<'_>) -> ConnectorResult<Started> {
    Ok(Started { mem: host_memory(s)?, transport: Arc::new(Shm::new(s.cfg.copy_threads)) })
}

/// A producer's segments, mapped.
struct Mapped {
    names: Vec<Option<String>>,
    maps: Vec<ShmMapping>,
}

/// The started backend: the producers' mapped segments, per producer.
pub struct Shm {
    copy_threads: usize,
    mapped: Mutex<HashMap<PeerKey, Arc<Mapped>>>,
}

impl Shm {
    /// Copies one large pull on up to `copy_threads` threads.
    pub fn new(copy_threads: usize) -> Shm {
        Shm { copy_threads, mapped: Mutex::default() }
    }

    /// The producer's segments, mapped once per producer and checked against its region sizes.
    fn map(&self, peer: &PeerInfo) -> Result<Arc<Mapped>, TransferError> {
        let names: Vec<Option<String>> = peer.meta.regions.iter().map(|r| r.shm_name.clone()).collect();
        let key = peer.key();
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = mapped.get(&key).filter(|m| m.names == names) {
            return Ok(m.clone());
        }
        let mut maps = Vec::with_capacity(names.len());
        for r in &peer.meta.regions {
            let name = r.shm_name.as_deref().ok_or_else(|| {
                TransferError::Plan(format!(
                    "producer engine '{}' region '{}' is not in shared memory, so backend shm cannot read \
                        it: use backend tcp, or let the producer's pool allocate shm regions",
                    peer.meta.engine_id, r.name
                ))
            })?;
            maps.push(ShmMapping::open(name, r.len)?);
        }
        let m = Arc::new(Mapped { names, maps });
        mapped.insert(key, m.clone());
        Ok(m)
    }
}

impl Transport for Shm {
    fn backend(&self) -> super::Backend {
        super::Backend::of(&BACKEND)
    }

    fn steps(&self) -> PullSteps {
        PullSteps { plan: true, before: Pin::Overlapped, after: Confirm::Release }
    }

    fn copy(
        &self,
        _: Option<&mut Streams<'_>>,
        local: &KvMemory,
        _: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: Option<&CopyPlan>,
    ) -> Result<PullStats, TransferError> {
        let plan = planned(plan)?;
        let mapped = self.map(peer)?;
        let src = |region: u32, off: u64, len: u64| -> Result<&[u8], TransferError> {
            let m = mapped
                .maps
                .get(region as usize)
                .ok_or_else(|| TransferError::Plan(format!("no producer region {region}")))?;
            let s = m.as_slice();
            let end = off.checked_add(len).filter(|e| *e <= s.len() as u64).ok_or_else(|| {
                TransferError::Plan(format!(
                    "{len} bytes at {off} do not fit producer segment '{}'",
                    m.name()
                ))
            })?;
            Ok(&s[off as usize..end as usize])
        };
        let mut dst = LocalRegions::new(local);
        match plan {
            CopyPlan::Direct(rs) => {
                dst.write_runs(rs, |r| src(r.src_region, r.src_off, r.len), self.copy_threads)?;
            }
            CopyPlan::Adapt(bs) => {
                for b in bs {
                    dst.scatter(&peer.geometry, load, b, src(b.src_region, b.src_off, b.len)?)?;
                }
            }
        }
        Ok(PullStats::of(plan))
    }

    fn forget(&self, key: &PeerKey) {
        self.mapped.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }
}

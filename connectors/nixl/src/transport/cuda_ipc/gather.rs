//! Backend `cuda_ipc`, the GPU side (feature `cuda`): exporting a producer's regions, and the
//! consumer's opened peers and gather kernel (see [`super`]).

use super::exports::{sources, Exports, Sources};
use super::launch_plan::{check_block, LaunchPlan};
use crate::config::CudaIpcPath;
use crate::error::TransferError;
use crate::metadata::LoadSpec;
use crate::metadata::{CudaIpcMetadata, PeerInfo, PeerKey};
use kvconnect_api::geometry::Geometry;
use kvconnect_api::{KvRegion, LayerId, MemoryKind};
use kvconnect_cuda::{
    CudaError, GatherKernel, GatherSpec, Gpu, ImportedRegion, IpcHandle, Permute, StagedCopy,
};
use std::collections::HashMap;
use std::sync::Arc;

/// How long the pull thread polls a copy's completion before it sleeps on it. Most loads end
/// within it (896 MiB in under 0.5 ms on an H200), and a thread woken from sleep costs more:
/// measured on an H200, a load of 512 scattered blocks took 0.44-0.46 of a contiguous copy
/// end to end polling and 0.40 sleeping at once (BENCHMARKS.md).
const POLL_BEFORE_SLEEP: std::time::Duration = std::time::Duration::from_millis(5);

/// Waits for `event`: polls it (yielding the core between looks) for up to
/// [`POLL_BEFORE_SLEEP`], then sleeps on it.
fn wait(event: &kvconnect_cuda::CudaEvent) -> Result<(), TransferError> {
    let poll_until = std::time::Instant::now() + POLL_BEFORE_SLEEP;
    loop {
        if event.try_is_complete().map_err(|e| TransferError::Cuda(format!("cuEventQuery: {e}")))? {
            return Ok(());
        }
        if std::time::Instant::now() >= poll_until {
            return event.synchronize().map_err(|e| TransferError::Cuda(format!("cuEventSynchronize: {e}")));
        }
        std::thread::yield_now();
    }
}

fn cuda(e: CudaError) -> TransferError {
    TransferError::Cuda(e.to_string())
}

fn plan_error(msg: String) -> TransferError {
    TransferError::Plan(msg)
}

/// Checks that every region is device memory on one GPU and opens that GPU.
pub fn open_gpu(regions: &[KvRegion]) -> Result<Arc<Gpu>, TransferError> {
    let mut device = None;
    for r in regions {
        if r.memory() != MemoryKind::Device || r.device() < 0 {
            return Err(plan_error(format!(
                "backend cuda_ipc needs device KV regions, but region '{}' is {:?} memory: set \
                    kv_buffer_device=\"cuda\" (or use backend shm/tcp for host KV)",
                r.name(),
                r.memory()
            )));
        }
        if device.is_some_and(|d| d != r.device()) {
            return Err(plan_error(format!(
                "backend cuda_ipc: region '{}' is on GPU {} but others on GPU {:?}: all KV regions of a \
                    worker must be on one GPU",
                r.name(),
                r.device(),
                device
            )));
        }
        device = Some(r.device());
    }
    let ordinal = device.unwrap_or(0) as usize;
    Gpu::open(ordinal).map(Arc::new).map_err(cuda)
}

/// Producer side: the IPC handle of each registered region, for the handshake, and the
/// record of them that a consumer in this same process reads them by (kept until the
/// regions go).
pub fn export(gpu: &Gpu, regions: &[KvRegion]) -> Result<(CudaIpcMetadata, Exports), TransferError> {
    let mut handles = Vec::with_capacity(regions.len());
    for r in regions {
        let h = IpcHandle::export_address(gpu, r.addr(), r.len() as usize)
            .map_err(|e| plan_error(format!("exporting region '{}': {e}", r.name())))?;
        handles.push(h.hex);
    }
    let pci_bus_id = gpu.pci_bus_id().ok();
    let exports = Exports::record(
        handles.iter().zip(regions).map(|(h, r)| (h.clone(), r.addr(), r.len())).collect(),
        pci_bus_id.clone(),
    );
    Ok((CudaIpcMetadata { device: gpu.ordinal() as i32, handles, pci_bus_id }, exports))
}

/// How the copy reaches a producer's memory.
enum Route {
    /// This GPU's kernel reads it (same GPU, or peer access).
    Direct,
    /// Through pinned host memory; the regions are mapped on the producer's GPU.
    Staged(Box<StagedCopy>),
}

struct Opened {
    handles: Vec<String>,
    /// Where they were found when opened.
    sources: Sources,
    /// Mapped regions (empty for a producer in this same process, whose regions are read
    /// where it registered them).
    _regions: Vec<ImportedRegion>,
    bases: Vec<u64>,
    route: Route,
    /// The gathers' plan for the handshake last loaded from.
    plan: Option<Arc<LaunchPlan>>,
}

/// Consumer side, owned by the pull thread: the GPU, the kernel (compiled at the first pull)
/// and each peer's opened regions.
pub struct CudaIpcPull {
    gpu: Arc<Gpu>,
    kernel: GatherKernel,
    /// Recorded after a request's launches; the pull thread sleeps on it.
    done: kvconnect_cuda::CudaEvent,
    opened: HashMap<PeerKey, Opened>,
    own: Vec<u64>,
    path: CudaIpcPath,
    /// A gather [`CudaIpcPull::launch`] started on the step's thread, until the pull thread
    /// waits for it (its `done` is recorded after it).
    launched: Option<Launched>,
    /// Time in the kernel's launch calls of the load being started (for its trace line).
    launch_time: std::time::Duration,
}

/// A gather launched ahead of its pull, and what it copies.
struct Launched {
    request: kvconnect_api::RequestId,
    peer: PeerKey,
    bytes: u64,
    adapted: bool,
}

impl Drop for CudaIpcPull {
    /// No launched gather reads or writes after the regions it copies between go.
    fn drop(&mut self) {
        self.settle();
    }
}

impl std::fmt::Debug for CudaIpcPull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcPull").field("gpu", &self.gpu.ordinal()).finish()
    }
}

impl CudaIpcPull {
    /// A consumer over this worker's device regions.
    /// Compiles (or takes from the process's cache) the gather kernel now, at start, so the
    /// first request does not wait for NVRTC and a GPU that cannot run it fails registration.
    pub fn new(
        gpu: Arc<Gpu>,
        own_regions: &[KvRegion],
        path: CudaIpcPath,
    ) -> Result<CudaIpcPull, TransferError> {
        Ok(CudaIpcPull {
            kernel: GatherKernel::new(&gpu).map_err(cuda)?,
            done: gpu.completion_event().map_err(cuda)?,
            gpu,
            opened: HashMap::new(),
            own: own_regions.iter().map(|r| r.addr()).collect(),
            path,
            launched: None,
            launch_time: std::time::Duration::ZERO,
        })
    }

    /// Whether the copy from producer `key` goes through host memory (None: not opened yet).
    pub fn staged(&self, key: &PeerKey) -> Option<bool> {
        self.opened.get(key).map(|o| matches!(o.route, Route::Staged(_)))
    }

    /// The producer's GPU as this process sees it (`local_bus`: the bus id this process
    /// exported the regions from, when it did), and whether the copy is staged (with why).
    fn choose(
        &self,
        e: &str,
        m: &CudaIpcMetadata,
        local_bus: Option<&Option<String>>,
    ) -> Result<(Arc<Gpu>, bool, String), TransferError> {
        let own_bus = self.gpu.pci_bus_id().map_err(cuda)?;
        let bus = local_bus.unwrap_or(&m.pci_bus_id);
        let producer = match bus {
            Some(bus) if bus.eq_ignore_ascii_case(&own_bus) => self.gpu.clone(),
            Some(bus) => match Gpu::open_by_pci_bus_id(bus).map_err(cuda)? {
                Some(g) => Arc::new(g),
                None => {
                    return Err(TransferError::Cuda(format!(
                        "producer engine '{e}' keeps its KV on GPU {bus}, which this process cannot see \
                            (CUDA_VISIBLE_DEVICES={}): make that GPU visible to this worker as well; CUDA \
                            IPC works between the GPUs of one host only",
                        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
                    )))
                }
            },
            // An older producer without a bus id: assume both processes number GPUs alike.
            None if m.device as usize == self.gpu.ordinal() => self.gpu.clone(),
            None => Arc::new(Gpu::open(m.device.max(0) as usize).map_err(cuda)?),
        };
        let prod_bus = producer.pci_bus_id().map_err(cuda)?;
        let between = format!("GPU {prod_bus} (producer) -> GPU {own_bus} (this worker)");
        if self.path == CudaIpcPath::Staged {
            return Ok((
                producer,
                true,
                format!("{between}: through pinned host memory (cuda_ipc_path = \"staged\")"),
            ));
        }
        if Arc::ptr_eq(&producer, &self.gpu) {
            return Ok((producer, false, format!("{between}: same GPU, direct")));
        }
        if self.gpu.can_access_peer(&producer).map_err(cuda)? {
            return Ok((
                producer,
                false,
                format!("{between}: peer access, the gather kernel reads the producer's GPU directly"),
            ));
        }
        if self.path == CudaIpcPath::Peer {
            return Err(TransferError::Cuda(format!(
                "{between}: this GPU cannot access the producer's memory (cuDeviceCanAccessPeer = 0) and \
                    cuda_ipc_path = \"peer\" forbids the host-staged copy: set cuda_ipc_path = \"auto\", or \
                    put both workers on GPUs with peer access (NVLink)"
            )));
        }
        Ok((
            producer,
            true,
            format!(
                "{between}: no peer access (cuDeviceCanAccessPeer = 0), copying through pinned host memory"
            ),
        ))
    }

    /// Forgets a peer's mapped regions (after any launched gather that may read them).
    pub fn forget(&mut self, key: &PeerKey) {
        self.settle();
        self.opened.remove(key);
    }

    /// Waits for the gather [`CudaIpcPull::launch`] started, if one still runs: after this no
    /// copy of it writes into this worker's blocks. Idempotent.
    pub fn settle(&mut self) {
        if self.launched.take().is_some() && wait(&self.done).is_err() {
            let _ = self.gpu.synchronize();
        }
    }

    /// The peer's regions as already opened, when they still are what it publishes (a
    /// producer of this process that is gone, or new handles, need `open_peer`).
    fn still_open(&self, peer: &PeerInfo) -> Option<&Opened> {
        let m = peer.meta.cuda_ipc.as_ref()?;
        let o = self.opened.get(&peer.key())?;
        let same = o.handles == m.handles
            && sources(&peer.meta.engine_id, m, &peer.meta.regions).is_ok_and(|s| s == o.sources);
        same.then_some(o)
    }

    /// Opens the peer's handles (once per peer, again when they changed) on the GPU the route
    /// needs: this one for direct reads, the producer's for the staged copy.
    fn open_peer(&mut self, peer: &PeerInfo) -> Result<&mut Opened, TransferError> {
        let e = &peer.meta.engine_id;
        let m = peer.meta.cuda_ipc.as_ref().ok_or_else(|| {
            plan_error(format!(
                "producer engine '{e}' published no CUDA IPC handles: it does not run backend cuda_ipc with \
                    device KV; use the same backend on both sides"
            ))
        })?;
        // Handles this process exported are read where it registered them (CUDA refuses to
        // open a process's own handles); nothing from the wire says which, or where. Asked
        // on every pull: a producer of this process that is gone is never read again.
        let sources = sources(e, m, &peer.meta.regions).map_err(plan_error)?;
        let key = peer.key();
        if self.opened.get(&key).is_some_and(|o| o.handles == m.handles && o.sources == sources) {
            return self.opened.get_mut(&key).ok_or_else(|| TransferError::UnknownPeer(e.clone()));
        }
        self.opened.remove(&key);
        let local_bus = match &sources {
            Sources::Local { pci_bus_id, .. } => Some(pci_bus_id),
            Sources::Import => None,
        };
        let (on, staged, why) = self.choose(e, m, local_bus)?;
        tracing::info!(engine = %e, "cuda_ipc: {why}");
        let (regions, bases) = match sources.clone() {
            Sources::Local { addrs, .. } => {
                // A kernel on another GPU reads them once peer access is enabled.
                if !staged
                    && !Arc::ptr_eq(&on, &self.gpu)
                    && !self.gpu.enable_peer_access(&on).map_err(cuda)?
                {
                    return Err(TransferError::Cuda(format!(
                        "producer engine '{e}': peer access from GPU {} to GPU {} could not be enabled",
                        self.gpu.ordinal(),
                        on.ordinal()
                    )));
                }
                (Vec::new(), addrs)
            }
            Sources::Import => {
                let map_on = if staged { &on } else { &self.gpu };
                let mut regions = Vec::with_capacity(m.handles.len());
                for (h, r) in m.handles.iter().zip(&peer.meta.regions) {
                    let handle = IpcHandle { hex: h.clone(), bytes: r.len as usize };
                    let mapped = ImportedRegion::open(map_on, &handle).map_err(|err| {
                        TransferError::Cuda(format!("producer engine '{e}' region '{}': {err}", r.name))
                    })?;
                    regions.push(mapped);
                }
                let bases = regions.iter().map(ImportedRegion::ptr).collect();
                (regions, bases)
            }
        };
        let route = if staged {
            let copy =
                StagedCopy::new(on, &self.gpu, kvconnect_cuda::staged::DEFAULT_CHUNK_BYTES).map_err(cuda)?;
            Route::Staged(Box::new(copy))
        } else {
            Route::Direct
        };
        let opened =
            Opened { handles: m.handles.clone(), sources, _regions: regions, bases, route, plan: None };
        Ok(self.opened.entry(key).or_insert(opened))
    }

    /// Starts `load`'s gather now, on the calling thread (the step's, in `start_load_kv`),
    /// when that costs no wait: no other gather of this consumer runs, and the peer's regions
    /// are open already (opening them is the pull thread's) and read directly (not staged).
    /// The pull thread's [`CudaIpcPull::pull`] of it then only waits; `Ok(false)`: not
    /// started, the pull copies it as usual. Bad loads are refused as `pull` refuses them.
    pub fn launch(
        &mut self,
        own: &Geometry,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
    ) -> Result<bool, TransferError> {
        // The host-staged route enqueues a chunk's copies at a time: the pull thread's.
        let direct = self.still_open(peer).is_some_and(|o| matches!(o.route, Route::Direct));
        if self.launched.is_some() || !direct {
            return Ok(false);
        }
        let t0 = std::time::Instant::now();
        let (bytes, adapted) = self.start(own, groups, peer, load)?;
        self.launched = Some(Launched { request: load.request.clone(), peer: peer.key(), bytes, adapted });
        tracing::debug!(request = %load.request, plan_and_launch_us = t0.elapsed().as_micros() as u64,
            "cuda_ipc: gather launched by start_load_kv");
        Ok(true)
    }

    /// Copies `load` from `peer` into this worker's regions (geometry `own`) and waits for
    /// the copy (on the calling pull thread). Once it is launched, `pin.started()` sends the
    /// puller's pin and `pin.answer()` reads its answer, both while the GPU copies; a gather
    /// [`CudaIpcPull::launch`] started already is only waited for. Returns, only once no copy
    /// of it runs any more, the bytes copied and whether a layout permute was fused in.
    pub fn pull(
        &mut self,
        own: &Geometry,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        pin: &mut dyn crate::transport::WhileCopying,
    ) -> Result<(u64, bool), TransferError> {
        let t0 = std::time::Instant::now();
        let ahead = match self.launched.take() {
            Some(l) if l.request == load.request && l.peer == peer.key() => Some(l),
            other => {
                // Another load's gather (not expected: a launched load is the pull thread's
                // next): it ends before this one starts.
                self.launched = other;
                self.settle();
                None
            }
        };
        let (bytes, adapted) = match ahead {
            Some(l) => (l.bytes, l.adapted),
            None => self.start(own, groups, peer, load)?,
        };
        let launched = t0.elapsed();
        // The pin goes out, and its answer comes back, while the GPU copies; the copy is
        // waited for whatever they did.
        let sent = pin.started();
        if sent.is_ok() {
            pin.answer();
        }
        let answered = t0.elapsed();
        if let Err(e) = wait(&self.done) {
            let _ = self.gpu.synchronize();
            return Err(e);
        }
        sent?;
        tracing::debug!(
            request = %load.request,
            plan_and_launch_us = launched.as_micros() as u64,
            pin_answered_at_us = answered.as_micros() as u64,
            kernel_waited_at_us = t0.elapsed().as_micros() as u64,
            "cuda_ipc: gather phases"
        );
        Ok((bytes, adapted))
    }

    /// Checks `load`, launches its gathers and records `done` after them: the bytes they
    /// copy and whether a layout permute is fused in. On an error nothing of it still runs.
    fn start(
        &mut self,
        own: &Geometry,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
    ) -> Result<(u64, bool), TransferError> {
        let t0 = std::time::Instant::now();
        let key = peer.key();
        let plan = self.plan_for(own, groups, peer, &key)?;
        let opened = t0.elapsed();
        let bp = plan.block_tokens;
        if !load.first_token.is_multiple_of(bp) {
            return Err(plan_error(format!(
                "request {}: backend cuda_ipc copies whole blocks, but loading starts at token {} inside a \
                    block of {bp}",
                load.request, load.first_token
            )));
        }
        if load.remote_blocks.0.len() != groups.len() || load.local_blocks.0.len() != groups.len() {
            return Err(plan_error(format!(
                "request {}: {} remote and {} local block lists for {} KV cache groups",
                load.request,
                load.remote_blocks.0.len(),
                load.local_blocks.0.len(),
                groups.len()
            )));
        }
        let mut any = false;
        self.launch_time = std::time::Duration::ZERO;
        let launches = self.launch_groups(&plan, &key, load, &mut any);
        if launches.is_err() && any {
            // A later group failed after an earlier one's gather was launched: none may still
            // write into this worker's blocks once the load is reported failed.
            let _ = self.gpu.synchronize();
        }
        let bytes = launches?;
        // Completion through an event after this request's launches: the pull thread waits
        // for it; the step loop only sees the outcome in get_finished.
        let planned = t0.elapsed();
        if let Err(e) = self.done.record(self.gpu.stream()) {
            let _ = self.gpu.synchronize();
            return Err(TransferError::Cuda(format!("cuEventRecord: {e}")));
        }
        // Where launching goes, for benchmarks (KVCONNECT_LOG=kvconnect_nixl=trace): `open_us`
        // includes planning the peer's gathers at its first load after a handshake.
        tracing::trace!(
            request = %load.request,
            open_us = opened.as_micros() as u64,
            plan_us = (planned - opened - self.launch_time).as_micros() as u64,
            launch_us = self.launch_time.as_micros() as u64,
            record_us = (t0.elapsed() - planned).as_micros() as u64,
            "cuda_ipc: launching"
        );
        Ok((bytes, plan.permute != Permute::None))
    }

    /// The peer's regions opened and its gathers' plan: kept from an earlier load of the same
    /// handshake, else made now (and kept).
    fn plan_for(
        &mut self,
        own: &Geometry,
        groups: &[Vec<LayerId>],
        peer: &PeerInfo,
        key: &PeerKey,
    ) -> Result<Arc<LaunchPlan>, TransferError> {
        let opened = self.open_peer(peer)?;
        if let Some(p) = opened.plan.as_ref().filter(|p| p.fits(peer, groups)) {
            return Ok(p.clone());
        }
        let src_all = opened.bases.clone();
        let plan = Arc::new(LaunchPlan::new(own, &self.own, groups, peer, &src_all)?);
        if let Some(o) = self.opened.get_mut(key) {
            o.plan = Some(plan.clone());
        }
        Ok(plan)
    }

    /// Launches one gather per KV cache group of `load` as `plan` says (`launched` set once
    /// one is), and returns the bytes they copy.
    fn launch_groups(
        &mut self,
        plan: &LaunchPlan,
        key: &PeerKey,
        load: &LoadSpec,
        launched: &mut bool,
    ) -> Result<u64, TransferError> {
        let bp = plan.block_tokens;
        let positions = if load.num_tokens > load.first_token {
            load.first_token / bp..load.num_tokens.div_ceil(bp)
        } else {
            0..0
        };
        let opened =
            self.opened.get_mut(key).ok_or_else(|| TransferError::UnknownPeer(key.engine.clone()))?;
        let mut bytes = 0u64;
        for (g, gp) in plan.per_group.iter().enumerate() {
            let (rl, ll) = (&load.remote_blocks.0[g], &load.local_blocks.0[g]);
            if positions.end > rl.len() || positions.end > ll.len() {
                return Err(plan_error(format!(
                    "request {}: tokens {}..{} of group {g} need {} blocks on each side, got {} remote and \
                        {} local",
                    load.request,
                    load.first_token,
                    load.num_tokens,
                    positions.end,
                    rl.len(),
                    ll.len()
                )));
            }
            if gp.src_bases.is_empty() {
                continue;
            }
            let (mut src_blocks, mut dst_blocks) =
                (Vec::with_capacity(positions.len()), Vec::with_capacity(positions.len()));
            for pos in positions.clone() {
                src_blocks.push(check_block(gp.src_blocks, rl[pos], "producer")?);
                dst_blocks.push(check_block(gp.dst_blocks, ll[pos], "local")?);
            }
            let spec = GatherSpec {
                src_bases: &gp.src_bases,
                dst_bases: &gp.dst_bases,
                src_blocks: &src_blocks,
                dst_blocks: &dst_blocks,
                block_bytes: gp.block_bytes,
                permute: plan.permute,
            };
            let t = std::time::Instant::now();
            match &mut opened.route {
                Route::Direct => self.kernel.launch(&self.gpu, &spec).map_err(cuda)?,
                Route::Staged(copy) => copy.copy(&self.gpu, &mut self.kernel, &spec).map_err(cuda)?,
            }
            self.launch_time += t.elapsed();
            *launched = true;
            bytes += gp.block_bytes * gp.src_bases.len() as u64 * src_blocks.len() as u64;
        }
        Ok(bytes)
    }
}

#[allow(unsafe_code)] // CUDA IPC: the producer's device regions opened in this process.
#[cfg(test)]
mod tests {
    use super::super::launch_plan::{per_layer, permute};
    use super::*;
    use kvconnect_api::geometry::{BlockShape, RegionShape};
    use kvconnect_api::{KvLayout, KvRegionSpec};

    fn geo(layout: KvLayout) -> Geometry {
        let shape = BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts: 2 };
        Geometry::new(shape, layout, vec![RegionShape { layers: vec![LayerId(0)], num_blocks: 8 }])
    }

    #[test]
    fn the_permute_follows_the_two_layouts() {
        let (nhd, hnd) = (geo(KvLayout::NHD), geo(KvLayout::HND));
        assert_eq!(permute(&hnd, &hnd).unwrap(), Permute::None);
        assert_eq!(permute(&nhd, &hnd).unwrap(), Permute::NhdToHnd { heads: 2, tokens: 4 });
        assert_eq!(permute(&hnd, &nhd).unwrap(), Permute::HndToNhd { heads: 2, tokens: 4 });
        assert!(per_layer(&hnd) && !per_layer(&geo(KvLayout::BLHNC)));
    }

    #[test]
    fn host_regions_are_refused_with_the_setting_to_change() {
        let spec = KvRegionSpec {
            name: "layer.0".into(),
            addr: 4096,
            len: 4096,
            memory: MemoryKind::Host,
            device: -1,
            layers: vec![LayerId(0)],
            group: 0,
            num_blocks: 8,
            shm_name: None,
        };
        // SAFETY: never dereferenced: `open_gpu` refuses the region by its memory kind.
        let r = unsafe { KvRegion::new(spec) };
        let Err(e) = open_gpu(&[r]) else { panic!("host regions accepted") };
        let e = e.to_string();
        assert!(e.contains("kv_buffer_device=\"cuda\"") && e.contains("layer.0"), "{e}");
    }
}

//! Staging a request's device KV blocks through pinned host memory.
//!
//! Host-side connectors (lmcache, flexkv) copy KV bytes with plain loads and stores through a
//! `KvMemory`. With KV regions in GPU memory they cannot, and a driver copy per block costs
//! microseconds of host time each. A [`KvStage`] instead gathers a request's blocks of every
//! layer and region into a pinned host buffer with ONE launch of the gather kernel, laid out
//! as a small copy of the same geometry whose blocks are `0..n` ([`HostCopy`]); the connector's
//! existing host code runs on that copy with block ids remapped `i -> BlockId(i)`, and a load
//! is scattered back with one launch. The kernel reads and writes the pinned buffer through
//! its device mapping, so there is no separate staging copy.
//!
//! Thread safety: the stage is `Sync`. Launches go to the GPU's one stream under a lock held
//! until the stream is synchronised, and every call binds the context on the calling thread,
//! so connector pool threads can use it. Pinned buffers are kept in a free list and reused
//! (grown when a request needs more); a `HostCopy` owns its buffer until it is dropped, so a
//! copy can be handed to another thread while the next request is gathered.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use crate::device::{Gpu, PinnedBuffer};
use crate::error::CudaError;
use crate::kernel::{GatherKernel, GatherSpec, Permute};
use crate::kv_units::{KvUnits, StageLayout, UnitsError};
use kvconnect_api::geometry::Geometry;
use kvconnect_api::kv_memory::{KvMemory, RegionError};
use kvconnect_api::{BlockId, EffectiveLayout, KvRegion, LayerId, MemoryKind, ModelSpec};
use std::sync::{Arc, Mutex};

/// Spare pinned buffers kept for reuse (more are freed when returned).
const KEEP_FREE: usize = 2;
/// Pinned buffers grow in steps of this many bytes, so a slightly longer request reuses one.
const GROW_STEP: usize = 2 << 20;

/// Why staging failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StageError {
    /// A region not in device memory.
    #[error("region '{name}' is {memory:?} memory; the device KV stage copies GPU regions only")]
    NotDevice {
        /// The region.
        name: String,
        /// Its memory kind.
        memory: MemoryKind,
    },
    /// Regions on two GPUs.
    #[error(
        "region '{name}' is on GPU {device} but region '{first_name}' is on GPU {first}: all KV regions \
        of a worker must be on one GPU"
    )]
    TwoGpus {
        /// The region.
        name: String,
        /// Its device.
        device: i32,
        /// The first region.
        first_name: String,
        /// The first region's device.
        first: i32,
    },
    /// No regions.
    #[error("no KV regions to stage")]
    NoRegions,
    /// A region the kernel's 16-byte copies cannot address.
    #[error(
        "region '{name}' starts at {addr:#x}, not a multiple of 16 bytes: the gather copies 16-byte \
        words; register regions as allocated by cuMemAlloc (256-byte aligned)"
    )]
    Misaligned {
        /// The region.
        name: String,
        /// Its address.
        addr: u64,
    },
    /// Regions that do not match the model and layout.
    #[error("registered device KV regions do not match the effective layout: {0}")]
    Regions(#[from] RegionError),
    /// A layout or shape one gather cannot copy.
    #[error(transparent)]
    Units(#[from] UnitsError),
    /// A block id outside the device regions.
    #[error("block {block} is outside the device KV regions ({num_blocks} blocks)")]
    BlockOutOfRange {
        /// The block.
        block: u32,
        /// Blocks in the smallest region.
        num_blocks: u32,
    },
    /// A staged index outside the host copy.
    #[error("host-copy block {index} is outside the copy of {n} blocks")]
    StagedOutOfRange {
        /// The index.
        index: u32,
        /// Blocks in the copy.
        n: u32,
    },
    /// A grid copy on a layout that keeps several layers in one block.
    #[error(
        "KV layout {0} keeps every layer of a block together; copies by (layer, K|V part) need a layout \
        with L before B (NHD, HND, ...)"
    )]
    GridLayout(String),
    /// A grid unit that is not one (layer, part) block.
    #[error("layer {layer} part {part}: {why}")]
    GridUnit {
        /// The layer.
        layer: u32,
        /// The K/V part.
        part: u32,
        /// What is wrong.
        why: String,
    },
    /// A grid block past the end of the grid's memory, or not 16-byte aligned.
    #[error(
        "grid unit {unit} block {index} does not fit the grid's {len} bytes at 16-byte alignment (unit \
        offset {offset}, {block_bytes}-byte blocks)"
    )]
    GridOutOfRange {
        /// The unit.
        unit: usize,
        /// The block index.
        index: u32,
        /// The unit's offset.
        offset: u64,
        /// Bytes of a block.
        block_bytes: u64,
        /// Bytes of the grid.
        len: u64,
    },
    /// The GPU, the driver or pinned memory failed.
    #[error("{what}: {error}")]
    Cuda {
        /// What was being done.
        what: &'static str,
        /// The driver's answer.
        error: CudaError,
    },
}

fn cuda(what: &'static str) -> impl FnOnce(CudaError) -> StageError {
    move |error| StageError::Cuda { what, error }
}

/// The GPU ordinal all `regions` are on: every region must be device memory on one GPU.
pub fn regions_gpu(regions: &[KvRegion]) -> Result<usize, StageError> {
    let first = regions.first().ok_or(StageError::NoRegions)?;
    for r in regions {
        if r.memory() != MemoryKind::Device || r.device() < 0 {
            return Err(StageError::NotDevice { name: r.name().to_owned(), memory: r.memory() });
        }
        if r.device() != first.device() {
            return Err(StageError::TwoGpus {
                name: r.name().to_owned(),
                device: r.device(),
                first_name: first.name().to_owned(),
                first: first.device(),
            });
        }
    }
    Ok(first.device() as usize)
}

type FreeList = Arc<Mutex<Vec<PinnedBuffer>>>;

/// Mapped pinned memory holding blocks in the caller's own arrangement (e.g. lmcache's chunk
/// slots): block `k` of unit `u` at `device_ptr + units[u].2 + k * block_bytes`, where
/// `block_bytes` is the stage's ([`KvStage::unit_shape`]) and every unit is one (layer, K|V
/// part) of a per-layer layout.
#[derive(Debug, Clone, Copy)]
pub struct BlockGrid<'a> {
    /// The memory's device address (a pinned buffer's mapping).
    pub device_ptr: u64,
    /// Bytes of the memory at `device_ptr`.
    pub len: u64,
    /// (layer, K|V part, byte offset of the unit's block 0) per unit.
    pub units: &'a [(LayerId, u32, u64)],
}

/// A host copy of `n` device blocks in pinned memory, addressed as blocks `0..n` of the
/// device regions' geometry.
pub struct HostCopy {
    buf: Option<PinnedBuffer>,
    mem: KvMemory,
    layout: StageLayout,
    n: u32,
    free: FreeList,
}

impl std::fmt::Debug for HostCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCopy").field("blocks", &self.n).field("bytes", &self.layout.bytes).finish()
    }
}

impl HostCopy {
    /// The copy as KV memory (blocks `0..n`), for the connector's host code.
    pub fn memory(&self) -> &KvMemory {
        &self.mem
    }

    /// Blocks held.
    pub fn blocks(&self) -> u32 {
        self.n
    }

    /// The block ids of the copy, `0..n`.
    pub fn block_ids(&self) -> Vec<BlockId> {
        (0..self.n).map(BlockId).collect()
    }

    /// Bytes of the copy.
    pub fn bytes(&self) -> usize {
        self.layout.bytes
    }

    fn device_ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, PinnedBuffer::device_ptr)
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            free.push(b);
            if free.len() > KEEP_FREE {
                // Keep the largest ones: they serve every smaller request too.
                free.sort_by_key(|b| std::cmp::Reverse(b.len()));
                free.truncate(KEEP_FREE);
            }
        }
    }
}

/// The device and grid base address of each grid unit, after checking that the layout keeps
/// one (layer, part) per block, that every unit's block is the stage's block, and that grid
/// blocks up to `max` of every unit lie inside the grid's memory at 16-byte alignment (the
/// kernel writes wherever these bases point, so this is the bound that keeps it in bounds).
fn grid_bases(
    geometry: &Geometry,
    regions: &[KvRegion],
    block_bytes: u64,
    grid: &BlockGrid<'_>,
    max: Option<u32>,
) -> Result<(Vec<u64>, Vec<u64>), StageError> {
    if geometry.layout().position(kvconnect_api::layout::Dim::B) == 0 {
        return Err(StageError::GridLayout(geometry.layout().display_name()));
    }
    let bb = block_bytes;
    let mut dev = Vec::with_capacity(grid.units.len());
    let mut dst = Vec::with_capacity(grid.units.len());
    for (u, (layer, part, offset)) in grid.units.iter().enumerate() {
        let unit_err = |why: String| StageError::GridUnit { layer: layer.0, part: *part, why };
        let span = geometry.span(*layer, *part, BlockId(0)).map_err(|e| unit_err(e.to_string()))?;
        if span.len as u64 != bb {
            return Err(unit_err(format!(
                "a block is {} bytes but the stage copies {bb}-byte blocks",
                span.len
            )));
        }
        let region = regions
            .get(span.region)
            .ok_or_else(|| unit_err(format!("region {} is not registered", span.region)))?;
        dev.push(region.addr() + span.offset as u64);
        let end = (max.unwrap_or(0) as u64 + 1).checked_mul(bb).and_then(|e| e.checked_add(*offset));
        let base = grid.device_ptr.checked_add(*offset);
        let fits = end.is_some_and(|e| e <= grid.len) && base.is_some_and(|b| b.is_multiple_of(16));
        if !fits {
            return Err(StageError::GridOutOfRange {
                unit: u,
                index: max.unwrap_or(0),
                offset: *offset,
                block_bytes: bb,
                len: grid.len,
            });
        }
        dst.push(grid.device_ptr + offset);
    }
    Ok((dev, dst))
}

/// The device regions of one worker, their copy units, the gather kernel and the pinned
/// buffers.
pub struct KvStage {
    gpu: Arc<Gpu>,
    regions: Vec<KvRegion>,
    model: ModelSpec,
    eff: EffectiveLayout,
    geometry: Geometry,
    /// Device address of each unit's block 0.
    bases: Vec<u64>,
    block_bytes: u64,
    min_blocks: u32,
    kernel: Mutex<GatherKernel>,
    free: FreeList,
}

impl std::fmt::Debug for KvStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStage")
            .field("gpu", &self.gpu.ordinal())
            .field("units", &self.bases.len())
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

impl KvStage {
    /// Opens the regions' GPU and builds the stage (see [`KvStage::new`]).
    pub fn open(
        regions: &[KvRegion],
        model: &ModelSpec,
        eff: &EffectiveLayout,
    ) -> Result<KvStage, StageError> {
        let ordinal = regions_gpu(regions)?;
        let gpu = Gpu::open(ordinal).map_err(cuda("opening the GPU of the device KV regions"))?;
        KvStage::new(Arc::new(gpu), regions, model, eff)
    }

    /// Checks the regions against the model and effective layout, splits them into copy
    /// units and compiles the gather kernel (so a GPU without NVRTC fails here, at
    /// registration, not at the first save).
    pub fn new(
        gpu: Arc<Gpu>,
        regions: &[KvRegion],
        model: &ModelSpec,
        eff: &EffectiveLayout,
    ) -> Result<KvStage, StageError> {
        let ordinal = regions_gpu(regions)?;
        if ordinal != gpu.ordinal() {
            return Err(StageError::TwoGpus {
                name: regions[0].name().to_owned(),
                device: ordinal as i32,
                first_name: format!("the stage's GPU {}", gpu.ordinal()),
                first: gpu.ordinal() as i32,
            });
        }
        if let Some(r) = regions.iter().find(|r| !r.addr().is_multiple_of(16)) {
            return Err(StageError::Misaligned { name: r.name().to_owned(), addr: r.addr() });
        }
        let mem = KvMemory::geometry_only(regions, model, eff)?;
        let geometry = mem.geometry().clone();
        let units = KvUnits::of(&geometry)?;
        let bases = units.units.iter().map(|u| regions[u.region].addr() + u.offset).collect();
        let min_blocks = regions.iter().map(|r| r.num_blocks()).min().unwrap_or(0);
        gpu.bind().map_err(cuda("binding the GPU"))?;
        let kernel = GatherKernel::new(&gpu).map_err(cuda("preparing the gather kernel"))?;
        Ok(KvStage {
            gpu,
            regions: regions.to_vec(),
            model: model.clone(),
            eff: eff.clone(),
            geometry,
            bases,
            block_bytes: units.block_bytes,
            min_blocks,
            kernel: Mutex::new(kernel),
            free: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The device regions' geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Bytes of one copied block of one unit, and the number of units.
    pub fn unit_shape(&self) -> (u64, usize) {
        (self.block_bytes, self.bases.len())
    }

    /// A host copy of `n` blocks whose contents are whatever the buffer held (a load fills
    /// it, then scatters the blocks it wrote).
    pub fn host_copy(&self, n: usize) -> Result<HostCopy, StageError> {
        let n32 = u32::try_from(n)
            .map_err(|_| StageError::StagedOutOfRange { index: u32::MAX, n: self.min_blocks })?;
        let layout = StageLayout::new(&self.geometry, n32)?;
        let buf = self.take_buffer(layout.bytes)?;
        // SAFETY: `buf` holds at least `layout.bytes` bytes, which the HostCopy owns for as
        // long as `mem` lives; the GPU touches the buffer only inside `gather`/`scatter`,
        // which synchronise the stream before returning, so host accesses never race a kernel.
        let host = unsafe { layout.host_regions(buf.as_slice().as_ptr() as u64, &self.regions) };
        let mem = KvMemory::new(&host, &self.model, &self.eff)?;
        Ok(HostCopy { buf: Some(buf), mem, layout, n: n32, free: self.free.clone() })
    }

    /// Gathers device `blocks` (of every layer and region) into a new host copy: block
    /// `blocks[i]` becomes the copy's block `i`. One launch; returns when the bytes are on
    /// the host.
    pub fn gather(&self, blocks: &[BlockId]) -> Result<HostCopy, StageError> {
        let mut copy = self.host_copy(blocks.len())?;
        let pairs: Vec<(BlockId, u32)> = blocks.iter().enumerate().map(|(i, b)| (*b, i as u32)).collect();
        self.gather_into(&mut copy, &pairs)?;
        Ok(copy)
    }

    /// Gathers `(device block, copy block)` pairs into an existing copy (a load that writes
    /// only part of a block first brings the block's current bytes up).
    pub fn gather_into(&self, copy: &mut HostCopy, pairs: &[(BlockId, u32)]) -> Result<(), StageError> {
        let (dev, staged) = self.check_pairs(copy, pairs)?;
        let dst: Vec<u64> = copy.layout.unit_offsets.iter().map(|o| copy.device_ptr() + o).collect();
        self.launch(&self.bases, &dst, &dev, &staged, "gathering device KV blocks into pinned memory")
    }

    /// Scatters `(copy block, device block)` pairs of a host copy back into the device
    /// regions. One launch; returns when the device holds the bytes.
    pub fn scatter(&self, copy: &HostCopy, pairs: &[(u32, BlockId)]) -> Result<(), StageError> {
        let flipped: Vec<(BlockId, u32)> = pairs.iter().map(|(i, b)| (*b, *i)).collect();
        let (dev, staged) = self.check_pairs(copy, &flipped)?;
        let src: Vec<u64> = copy.layout.unit_offsets.iter().map(|o| copy.device_ptr() + o).collect();
        self.launch(&src, &self.bases, &staged, &dev, "scattering pinned KV blocks into the device regions")
    }

    /// Gathers `(device block, grid block)` pairs of every grid unit straight into the
    /// grid's memory. One launch; returns when the bytes are on the host.
    pub fn gather_to_grid(&self, grid: &BlockGrid<'_>, pairs: &[(BlockId, u32)]) -> Result<(), StageError> {
        let max = pairs.iter().map(|(_, k)| *k).max();
        let (dev_bases, grid_bases) = grid_bases(&self.geometry, &self.regions, self.block_bytes, grid, max)?;
        let (dev, idx) = self.check_device_blocks(pairs.iter().map(|(b, k)| (*b, *k)))?;
        self.launch(&dev_bases, &grid_bases, &dev, &idx, "gathering device KV blocks into pinned chunk slots")
    }

    /// Scatters `(grid block, device block)` pairs of every grid unit from the grid's memory
    /// into the device regions. One launch; returns when the device holds the bytes.
    pub fn scatter_from_grid(
        &self,
        grid: &BlockGrid<'_>,
        pairs: &[(u32, BlockId)],
    ) -> Result<(), StageError> {
        let max = pairs.iter().map(|(k, _)| *k).max();
        let (dev_bases, grid_bases) = grid_bases(&self.geometry, &self.regions, self.block_bytes, grid, max)?;
        let (dev, idx) = self.check_device_blocks(pairs.iter().map(|(k, b)| (*b, *k)))?;
        self.launch(
            &grid_bases,
            &dev_bases,
            &idx,
            &dev,
            "scattering pinned chunk slots into the device regions",
        )
    }

    fn check_device_blocks(
        &self,
        pairs: impl Iterator<Item = (BlockId, u32)>,
    ) -> Result<(Vec<u32>, Vec<u32>), StageError> {
        let mut dev = Vec::new();
        let mut idx = Vec::new();
        for (b, k) in pairs {
            if b.0 >= self.min_blocks {
                return Err(StageError::BlockOutOfRange { block: b.0, num_blocks: self.min_blocks });
            }
            dev.push(b.0);
            idx.push(k);
        }
        Ok((dev, idx))
    }

    fn check_pairs(
        &self,
        copy: &HostCopy,
        pairs: &[(BlockId, u32)],
    ) -> Result<(Vec<u32>, Vec<u32>), StageError> {
        let mut dev = Vec::with_capacity(pairs.len());
        let mut staged = Vec::with_capacity(pairs.len());
        for (b, i) in pairs {
            if b.0 >= self.min_blocks {
                return Err(StageError::BlockOutOfRange { block: b.0, num_blocks: self.min_blocks });
            }
            if *i >= copy.n {
                return Err(StageError::StagedOutOfRange { index: *i, n: copy.n });
            }
            dev.push(b.0);
            staged.push(*i);
        }
        Ok((dev, staged))
    }

    fn launch(
        &self,
        src_bases: &[u64],
        dst_bases: &[u64],
        src_blocks: &[u32],
        dst_blocks: &[u32],
        what: &'static str,
    ) -> Result<(), StageError> {
        if src_blocks.is_empty() {
            return Ok(());
        }
        let spec = GatherSpec {
            src_bases,
            dst_bases,
            src_blocks,
            dst_blocks,
            block_bytes: self.block_bytes,
            permute: Permute::None,
        };
        // The lock covers launch and synchronisation: the kernel's index scratch is reused
        // and the caller reads the pinned bytes right after this returns.
        let mut kernel = self.kernel.lock().unwrap_or_else(|e| e.into_inner());
        self.gpu.bind().map_err(cuda(what))?;
        kernel.launch(&self.gpu, &spec).map_err(cuda(what))?;
        self.gpu.synchronize().map_err(cuda(what))
    }

    fn take_buffer(&self, bytes: usize) -> Result<PinnedBuffer, StageError> {
        let reuse = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            // The smallest buffer that fits.
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= bytes)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            match best {
                Some(i) => Some(free.swap_remove(i)),
                None => {
                    // Nothing fits: drop the largest spare (too small anyway) before
                    // pinning more memory.
                    free.sort_by_key(|b| b.len());
                    free.pop();
                    None
                }
            }
        };
        if let Some(b) = reuse {
            return Ok(b);
        }
        let cap = bytes.max(1).div_ceil(GROW_STEP) * GROW_STEP;
        self.gpu.alloc_pinned(cap).map_err(cuda("allocating pinned host memory for the KV host copy"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_api::KvRegionSpec;

    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}

    #[test]
    fn stage_is_shared_and_copies_move_between_threads() {
        send_sync::<KvStage>();
        send::<HostCopy>();
    }

    fn spec(name: &str, memory: MemoryKind, device: i32) -> KvRegionSpec {
        KvRegionSpec {
            name: name.into(),
            addr: 0x1000,
            len: 64,
            memory,
            device,
            layers: vec![],
            group: 0,
            num_blocks: 1,
            shm_name: None,
        }
    }

    /// A region no test dereferences: these tests check descriptions and address arithmetic.
    fn vouched(spec: KvRegionSpec) -> KvRegion {
        // SAFETY: nothing reads or writes through the regions these tests make.
        unsafe { KvRegion::new(spec) }
    }

    fn region(name: &str, memory: MemoryKind, device: i32) -> KvRegion {
        vouched(spec(name, memory, device))
    }

    #[test]
    fn grid_bases_bound_every_unit_inside_the_grid() {
        use kvconnect_api::geometry::{BlockShape, RegionShape};
        use kvconnect_api::KvLayout;
        let shape = BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts: 2 };
        let bb = shape.bytes() as u64; // 128
        let g = Geometry::new(
            shape,
            KvLayout::NHD,
            (0..2).map(|l| RegionShape { layers: vec![LayerId(l)], num_blocks: 10 }).collect(),
        );
        let regions: Vec<KvRegion> = (0..2)
            .map(|l| {
                vouched(KvRegionSpec {
                    addr: 0x10_0000 * (l + 1),
                    len: 2 * 10 * bb,
                    layers: vec![LayerId(l as u32)],
                    num_blocks: 10,
                    ..spec("r", MemoryKind::Device, 0)
                })
            })
            .collect();
        // Chunk-like grid: units (layer, part) 3 blocks apart, 2 slots of 12 blocks.
        let units: Vec<(LayerId, u32, u64)> =
            (0..4).map(|u| (LayerId(u / 2), u % 2, u as u64 * 3 * bb)).collect();
        let grid = BlockGrid { device_ptr: 0x9000_0000, len: 24 * bb, units: &units };
        let (dev, dst) = grid_bases(&g, &regions, bb, &grid, Some(12 + 2)).unwrap();
        // Device bases: layer l's K at the region start, V 10 blocks later.
        assert_eq!(dev, vec![0x10_0000, 0x10_0000 + 10 * bb, 0x20_0000, 0x20_0000 + 10 * bb]);
        assert_eq!(dst, vec![0x9000_0000, 0x9000_0000 + 3 * bb, 0x9000_0000 + 6 * bb, 0x9000_0000 + 9 * bb]);
        // The last unit's block 15 would end past the grid's 24 blocks.
        let e = grid_bases(&g, &regions, bb, &grid, Some(15)).unwrap_err();
        assert!(matches!(e, StageError::GridOutOfRange { unit: 3, index: 15, .. }), "{e}");
        let e = grid_bases(&g, &regions, bb, &BlockGrid { device_ptr: 0x9000_0008, ..grid }, Some(0))
            .unwrap_err();
        assert!(e.to_string().contains("16-byte alignment"), "{e}");
        let bad = [(LayerId(5), 0, 0)];
        let e = grid_bases(&g, &regions, bb, &BlockGrid { units: &bad, ..grid }, Some(0)).unwrap_err();
        assert!(e.to_string().starts_with("layer 5 part 0:"), "{e}");
        let cross = Geometry::new(
            shape,
            KvLayout::BLNHC,
            vec![RegionShape { layers: vec![LayerId(0), LayerId(1)], num_blocks: 10 }],
        );
        let e = grid_bases(&cross, &regions[..1], 4 * bb, &grid, Some(0)).unwrap_err().to_string();
        assert!(e.contains("BLNHC") && e.contains("L before B"), "{e}");
    }

    #[test]
    fn regions_must_be_device_memory_on_one_gpu() {
        assert_eq!(
            regions_gpu(&[region("a", MemoryKind::Device, 1), region("b", MemoryKind::Device, 1)]),
            Ok(1)
        );
        let e = regions_gpu(&[region("a", MemoryKind::Device, 0), region("b", MemoryKind::Device, 1)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("'b' is on GPU 1 but region 'a' is on GPU 0"), "{e}");
        let e = regions_gpu(&[region("a", MemoryKind::Host, -1)]).unwrap_err().to_string();
        assert!(e.contains("'a' is Host memory"), "{e}");
        assert_eq!(regions_gpu(&[]), Err(StageError::NoRegions));
    }
}

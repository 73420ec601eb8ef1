//! The baseline of `kvconnect bench transfer --backend nixl`: the same transfer through bare
//! `nixl-sys` calls with nothing of kvconnect around them — two agents in one process (UCX),
//! two DRAM buffers registered, metadata exchanged, one READ of `descriptors` equal runs,
//! polled until done.

#![allow(unsafe_code)] // NIXL bindings: raw buffers handed to the NIXL C API.

use kvconnect_nixl::nixl_agent::{status_name, NixlCallError};
use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, NixlError, XferDescList, XferOp, XferStatus};
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Buf {
    p: *const u8,
    n: usize,
}
// SAFETY: only the pointer value crosses threads; the Vec it points into outlives the agents.
unsafe impl Send for Buf {}
// SAFETY: as above; NIXL only reads the pointer and size.
unsafe impl Sync for Buf {}
impl MemoryRegion for Buf {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.p
    }
    fn size(&self) -> usize {
        self.n
    }
}
impl NixlDescriptor for Buf {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

fn err(op: &str) -> impl FnOnce(NixlError) -> NixlCallError + '_ {
    move |e| NixlCallError::Status { op: op.to_owned(), status: status_name(&e), detail: e.to_string() }
}

/// Two agents and two registered buffers, ready to READ `bytes` in `descriptors` runs.
pub struct RawNixlRead {
    // Field order is drop order: registrations, then agents, then the buffers they point at.
    _regs: (nixl_sys::RegistrationHandle, nixl_sys::RegistrationHandle),
    reader: Agent,
    _owner: Agent,
    owner_name: String,
    src: Vec<u8>,
    dst: Vec<u8>,
    descriptors: usize,
}

impl std::fmt::Debug for RawNixlRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawNixlRead")
            .field("bytes", &self.src.len())
            .field("descriptors", &self.descriptors)
            .finish()
    }
}

impl RawNixlRead {
    /// Loads the library, creates both agents (UCX) and registers both buffers.
    pub fn new(bytes: usize, descriptors: usize) -> Result<RawNixlRead, NixlCallError> {
        kvconnect_nixl::nixl_lib::load()?;
        let pid = std::process::id();
        let (pa, da) = (format!("raw-prefill-{pid}"), format!("raw-decode-{pid}"));
        let a = Agent::new(&pa).map_err(err("createAgent"))?;
        let b = Agent::new(&da).map_err(err("createAgent"))?;
        let (_m, params) = a.get_plugin_params("UCX").map_err(err("getPluginParams"))?;
        a.create_backend("UCX", &params).map_err(err("createBackend"))?;
        b.create_backend("UCX", &params).map_err(err("createBackend"))?;
        let src: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; bytes];
        let h1 = a.register_memory(&Buf { p: src.as_ptr(), n: bytes }, None).map_err(err("registerMem"))?;
        let h2 =
            b.register_memory(&Buf { p: dst.as_mut_ptr(), n: bytes }, None).map_err(err("registerMem"))?;
        let md = a.get_local_md().map_err(err("getLocalMD"))?;
        b.load_remote_md(&md).map_err(err("loadRemoteMD"))?;
        Ok(RawNixlRead {
            _regs: (h1, h2),
            reader: b,
            _owner: a,
            owner_name: pa,
            src,
            dst,
            descriptors: descriptors.max(1),
        })
    }

    /// One READ of every byte: build the descriptor lists, create, post, poll until done.
    pub fn measure(&mut self) -> Result<Duration, NixlCallError> {
        let bytes = self.src.len();
        let chunk = bytes.div_ceil(self.descriptors).max(1);
        let mut local = XferDescList::new(MemType::Dram).map_err(err("descriptor list"))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(err("descriptor list"))?;
        for off in (0..bytes).step_by(chunk) {
            let len = chunk.min(bytes - off);
            local.add_desc(self.dst.as_ptr() as usize + off, len, 0);
            remote.add_desc(self.src.as_ptr() as usize + off, len, 0);
        }
        // Cleared first so that `verify` checks this READ, not an earlier one.
        self.dst.fill(0);
        let b = &self.reader;
        let t = Instant::now();
        let req = b
            .create_xfer_req(XferOp::Read, &local, &remote, &self.owner_name, None)
            .map_err(err("createXferReq"))?;
        let mut busy = b.post_xfer_req(&req, None).map_err(err("postXferReq"))?;
        // The connector's pull thread polls the same way (spin, then yield): on a loaded
        // machine a bare spin starves the progress threads and would flatter the connector.
        let mut spins = 0u32;
        while busy {
            busy = matches!(b.get_xfer_status(&req).map_err(err("getXferStatus"))?, XferStatus::InProgress);
            spins += 1;
            if spins > 1000 {
                std::thread::yield_now();
            }
        }
        Ok(t.elapsed())
    }

    /// Whether the destination holds the source's bytes (after a [`measure`](Self::measure)).
    pub fn verify(&self) -> bool {
        self.dst == self.src
    }
}

/// Best time of `repeat` READs of `bytes` split into `descriptors` runs (after one warm-up),
/// and whether the last one delivered every byte.
pub fn raw_read_best(
    bytes: usize,
    descriptors: usize,
    repeat: usize,
) -> Result<(Duration, bool), NixlCallError> {
    let mut r = RawNixlRead::new(bytes, descriptors)?;
    let mut best = Duration::MAX;
    for i in 0..repeat.max(1) + 1 {
        let t = r.measure()?;
        if i > 0 {
            best = best.min(t);
        }
    }
    Ok((best, r.verify()))
}

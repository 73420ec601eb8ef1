//! The baseline of `kvconnect bench transfer --backend nixl`: the same transfer through bare
//! `nixl-sys` calls with nothing of kvconnect around them — two agents in one process (UCX),
//! two DRAM buffers registered, metadata exchanged, one READ of `descriptors` equal runs,
//! polled until done.

use crate::nixl_agent::{status_name, NixlCallError};
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

/// Best time of `repeat` READs of `bytes` split into `descriptors` runs (after one warm-up),
/// and whether the last one delivered every byte.
pub fn raw_read_best(
    bytes: usize,
    descriptors: usize,
    repeat: usize,
) -> Result<(Duration, bool), NixlCallError> {
    crate::nixl_lib::load()?;
    let pid = std::process::id();
    let (pa, da) = (format!("raw-prefill-{pid}"), format!("raw-decode-{pid}"));
    let a = Agent::new(&pa).map_err(err("createAgent"))?;
    let b = Agent::new(&da).map_err(err("createAgent"))?;
    let (_m, params) = a.get_plugin_params("UCX").map_err(err("getPluginParams"))?;
    let _ba = a.create_backend("UCX", &params).map_err(err("createBackend"))?;
    let _bb = b.create_backend("UCX", &params).map_err(err("createBackend"))?;
    let src: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; bytes];
    let _h1 = a.register_memory(&Buf { p: src.as_ptr(), n: bytes }, None).map_err(err("registerMem"))?;
    let _h2 = b.register_memory(&Buf { p: dst.as_mut_ptr(), n: bytes }, None).map_err(err("registerMem"))?;
    let md = a.get_local_md().map_err(err("getLocalMD"))?;
    b.load_remote_md(&md).map_err(err("loadRemoteMD"))?;
    let d = descriptors.max(1);
    let chunk = bytes.div_ceil(d);
    let mut best = Duration::MAX;
    for _ in 0..repeat.max(1) + 1 {
        let mut local = XferDescList::new(MemType::Dram).map_err(err("descriptor list"))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(err("descriptor list"))?;
        for off in (0..bytes).step_by(chunk) {
            let len = chunk.min(bytes - off);
            local.add_desc(dst.as_ptr() as usize + off, len, 0);
            remote.add_desc(src.as_ptr() as usize + off, len, 0);
        }
        let t = Instant::now();
        let req =
            b.create_xfer_req(XferOp::Read, &local, &remote, &pa, None).map_err(err("createXferReq"))?;
        let mut busy = b.post_xfer_req(&req, None).map_err(err("postXferReq"))?;
        while busy {
            busy = matches!(b.get_xfer_status(&req).map_err(err("getXferStatus"))?, XferStatus::InProgress);
        }
        best = best.min(t.elapsed());
    }
    let ok = dst == src;
    Ok((best, ok))
}

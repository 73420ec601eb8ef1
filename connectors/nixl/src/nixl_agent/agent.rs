//! The NIXL agent over `nixl-sys` (feature `nixl`).

#![allow(unsafe_code)] // NIXL bindings: the agent over the NIXL C API.

use super::{NixlCallError, NixlMem, ReadPair, UCX};
use crate::nixl_lib;
use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, RegistrationHandle,
    XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// NIXL's name for the status behind a `nixl_sys` error.
pub fn status_name(e: &NixlError) -> &'static str {
    match e {
        NixlError::InvalidParam | NixlError::StringConversionError(_) | NixlError::InvalidDataPointer => {
            "NIXL_ERR_INVALID_PARAM"
        }
        NixlError::NotFound => "NIXL_ERR_NOT_FOUND",
        NixlError::IndexOutOfBounds => "NIXL_ERR_INVALID_PARAM",
        NixlError::NoTelemetry => "NIXL_ERR_NO_TELEMETRY",
        NixlError::BackendError
        | NixlError::FailedToCreateXferRequest
        | NixlError::RegDescListCreationFailed
        | NixlError::RegDescAddFailed
        | NixlError::FailedToCreateXferDlistHandle
        | NixlError::FailedToCreateBackend => "NIXL_ERR_BACKEND",
    }
}

fn call(op: impl Into<String>) -> impl FnOnce(NixlError) -> NixlCallError {
    let op = op.into();
    move |e| NixlCallError::Status { op, status: status_name(&e), detail: e.to_string() }
}

/// A memory range to register (NIXL reads the pointer, size, type and device only).
#[derive(Debug)]
struct Range {
    addr: usize,
    len: usize,
    mem: NixlMem,
}

fn mem_type(m: NixlMem) -> MemType {
    match m {
        NixlMem::Dram => MemType::Dram,
        NixlMem::Vram(_) => MemType::Vram,
    }
}

/// The device id NIXL is given (0 for host memory).
fn device(m: NixlMem) -> u64 {
    match m {
        NixlMem::Dram => 0,
        NixlMem::Vram(d) => d,
    }
}

impl MemoryRegion for Range {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Range {
    fn mem_type(&self) -> MemType {
        mem_type(self.mem)
    }
    fn device_id(&self) -> u64 {
        device(self.mem)
    }
}

/// A posted transfer; dropping it releases (and, if unfinished, aborts) it.
pub struct Transfer {
    req: XferRequest,
    bytes: u64,
    descriptors: usize,
}

impl Transfer {
    /// Bytes it moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Descriptors it was built from.
    pub fn descriptors(&self) -> usize {
        self.descriptors
    }
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("bytes", &self.bytes)
            .field("descriptors", &self.descriptors)
            .finish()
    }
}

/// nixl-sys notes that agents created concurrently may deadlock; creation is serialised.
static CREATE: Mutex<()> = Mutex::new(());

/// A descriptor list NIXL prepared (`prepXferDlist`), kept by the agent that made it.
struct PreparedHandle(XferDlistHandle);

// SAFETY: the handle is a pointer NIXL owns; it is only passed back to the agent that made
// it (whose calls nixl-sys serialises under the agent's lock) and released in Drop, which
// runs before that agent is dropped (it lives in the agent's own table, declared before it).
unsafe impl Send for PreparedHandle {}
// SAFETY: as above; shared use only reads the pointer.
unsafe impl Sync for PreparedHandle {}

/// A NIXL agent with the UCX backend and its registrations.
pub struct NixlAgent {
    // Field order is drop order: the prepared lists hold a pointer to the agent and are
    // released first.
    prepared: Mutex<HashMap<u64, PreparedHandle>>,
    next_prepared: AtomicU64,
    agent: Agent,
    name: String,
    /// Memory types the UCX backend says it can move.
    mems: Vec<MemType>,
}

/// A descriptor list prepared once (`prepXferDlist`) over this agent's memory or a peer's:
/// transfers then name its entries by index (`makeXferReq`), which NIXL merges where they are
/// contiguous on both sides. Released by [`NixlAgent::release_prepared`], or with the agent.
#[derive(Debug, PartialEq, Eq)]
pub struct Prepared {
    id: u64,
    entries: usize,
    remote: Option<String>,
}

impl Prepared {
    /// Its entries.
    pub fn entries(&self) -> usize {
        self.entries
    }
}

/// A registered memory range; deregistered on drop.
#[derive(Debug)]
pub struct Registration {
    _handle: RegistrationHandle,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent").field("name", &self.name).finish()
    }
}

impl NixlAgent {
    /// Loads the library if needed and creates agent `name` with the UCX backend.
    pub fn new(name: &str) -> Result<NixlAgent, NixlCallError> {
        nixl_lib::load()?;
        let _g = CREATE.lock().unwrap_or_else(|p| p.into_inner());
        let agent = Agent::new(name).map_err(call(format!("createAgent('{name}')")))?;
        let (plugin_mems, params) = agent.get_plugin_params(UCX).map_err(call("getPluginParams(UCX)"))?;
        let backend = agent.create_backend(UCX, &params).map_err(call("createBackend(UCX)"))?;
        // What the created backend reports; the plugin's static list if it reports nothing.
        let mems = match agent.get_backend_params(&backend) {
            Ok((m, _)) => m.iter().filter_map(Result::ok).collect(),
            Err(_) => plugin_mems.iter().filter_map(Result::ok).collect(),
        };
        Ok(NixlAgent {
            prepared: Mutex::default(),
            next_prepared: AtomicU64::new(0),
            agent,
            name: name.to_owned(),
            mems,
        })
    }

    /// Whether the UCX backend lists `mem`'s memory type among those it can move.
    pub fn supports(&self, mem: NixlMem) -> bool {
        self.mems.contains(&mem_type(mem))
    }

    /// The memory types the UCX backend lists, for messages ("Dram, Vram").
    pub fn memory_types(&self) -> String {
        self.mems.iter().map(|m| format!("{m:?}")).collect::<Vec<_>>().join(", ")
    }

    /// This agent's name (what peers address it by).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers `len` bytes of host memory at `addr` with the UCX backend.
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay valid host memory until this agent is dropped: remote
    /// agents may read it at any time.
    pub unsafe fn register_dram(&self, addr: usize, len: usize) -> Result<Registration, NixlCallError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.register(addr, len, NixlMem::Dram) }
    }

    /// Registers `len` bytes at `addr` in `mem` (host memory, or GPU memory of a device).
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay valid memory of that kind (for VRAM: `cuMemAlloc`
    /// memory of that GPU) until this agent is dropped: remote agents may read it at any time.
    pub unsafe fn register(
        &self,
        addr: usize,
        len: usize,
        mem: NixlMem,
    ) -> Result<Registration, NixlCallError> {
        let h = self
            .agent
            .register_memory(&Range { addr, len, mem }, None)
            .map_err(call(format!("registerMem({} {len} bytes at {addr:#x})", mem.describe())))?;
        Ok(Registration { _handle: h })
    }

    /// This agent's metadata (backend connection info and registrations) for peers.
    pub fn local_md(&self) -> Result<Vec<u8>, NixlCallError> {
        self.agent.get_local_md().map_err(call("getLocalMD"))
    }

    /// Loads a peer's metadata; returns the peer agent's name.
    pub fn load_remote_md(&self, md: &[u8]) -> Result<String, NixlCallError> {
        self.agent.load_remote_md(md).map_err(call(format!("loadRemoteMD({} bytes)", md.len())))
    }

    /// Forgets a peer's metadata (before loading a newer copy).
    pub fn invalidate_remote(&self, remote: &str) {
        let _ = self.agent.invalidate_remote_md(remote);
    }

    /// Posts one READ of `pairs` from `remote`'s registered host memory into this agent's.
    pub fn post_read(&self, remote: &str, pairs: &[ReadPair]) -> Result<Transfer, NixlCallError> {
        self.post_read_mem(remote, pairs, NixlMem::Dram, NixlMem::Dram)
    }

    /// Posts one READ of `pairs` from `remote`'s registered memory of kind `far_mem` into this
    /// agent's memory of kind `local_mem` (e.g. VRAM to VRAM).
    pub fn post_read_mem(
        &self,
        remote: &str,
        pairs: &[ReadPair],
        local_mem: NixlMem,
        far_mem: NixlMem,
    ) -> Result<Transfer, NixlCallError> {
        let mut local = XferDescList::new(mem_type(local_mem)).map_err(call("creating a descriptor list"))?;
        let mut far = XferDescList::new(mem_type(far_mem)).map_err(call("creating a descriptor list"))?;
        let mut bytes = 0u64;
        for p in pairs {
            local.add_desc(p.local, p.len, device(local_mem));
            far.add_desc(p.remote, p.len, device(far_mem));
            bytes += p.len as u64;
        }
        let op = || {
            format!(
                "READ of {bytes} bytes in {} descriptors from agent '{remote}' ({} into {})",
                pairs.len(),
                far_mem.describe(),
                local_mem.describe()
            )
        };
        let req = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &far, remote, None)
            .map_err(call(format!("createXferReq({})", op())))?;
        self.agent.post_xfer_req(&req, None).map_err(call(format!("postXferReq({})", op())))?;
        Ok(Transfer { req, bytes, descriptors: pairs.len() })
    }

    /// Prepares `ranges` (address, bytes) of memory of kind `mem` as one descriptor list:
    /// this agent's registered memory (`remote` None), or agent `remote`'s (whose metadata
    /// is loaded; NIXL checks every range against that agent's registrations now).
    pub fn prepare(
        &self,
        remote: Option<&str>,
        ranges: &[(usize, usize)],
        mem: NixlMem,
    ) -> Result<Prepared, NixlCallError> {
        let mut list = XferDescList::new(mem_type(mem)).map_err(call("creating a descriptor list"))?;
        for &(addr, len) in ranges {
            list.add_desc(addr, len, device(mem));
        }
        let whose = remote.map_or_else(|| "this agent".to_owned(), |r| format!("agent '{r}'"));
        let handle = self.agent.prepare_xfer_dlist(remote.unwrap_or(""), &list, None).map_err(call(
            format!("prepXferDlist({} descriptors of {} of {whose})", ranges.len(), mem.describe()),
        ))?;
        let id = self.next_prepared.fetch_add(1, Ordering::Relaxed);
        self.prepared.lock().unwrap_or_else(|p| p.into_inner()).insert(id, PreparedHandle(handle));
        Ok(Prepared { id, entries: ranges.len(), remote: remote.map(str::to_owned) })
    }

    /// Releases a prepared list.
    pub fn release_prepared(&self, p: Prepared) {
        self.prepared.lock().unwrap_or_else(|p| p.into_inner()).remove(&p.id);
    }

    /// Posts one READ of entries `far_idx` of `far` (a peer's list) into entries `local_idx`
    /// of `local` (this agent's), pairwise; `bytes` is what they add up to, for messages.
    pub fn post_read_prepared(
        &self,
        local: &Prepared,
        local_idx: &[i32],
        far: &Prepared,
        far_idx: &[i32],
        bytes: u64,
    ) -> Result<Transfer, NixlCallError> {
        let remote = far.remote.as_deref().unwrap_or("?");
        let op = || {
            format!("READ of {bytes} bytes in {} prepared descriptors from agent '{remote}'", far_idx.len())
        };
        let bad = |what: &str| NixlCallError::Status {
            op: format!("makeXferReq({})", op()),
            status: "NIXL_ERR_INVALID_PARAM",
            detail: what.to_owned(),
        };
        if local.remote.is_some() || far.remote.is_none() || local_idx.len() != far_idx.len() {
            return Err(bad("a local list, a peer's list and as many entries of each are needed"));
        }
        let in_range = |idx: &[i32], n: usize| idx.iter().all(|&i| i >= 0 && (i as usize) < n);
        if !in_range(local_idx, local.entries) || !in_range(far_idx, far.entries) {
            return Err(bad("an index past the end of its prepared list"));
        }
        let req = {
            let table = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
            let (Some(l), Some(f)) = (table.get(&local.id), table.get(&far.id)) else {
                return Err(bad("a prepared list that was released"));
            };
            self.agent
                .make_xfer_req(XferOp::Read, &l.0, local_idx, &f.0, far_idx, None)
                .map_err(call(format!("makeXferReq({})", op())))?
        };
        self.agent.post_xfer_req(&req, None).map_err(call(format!("postXferReq({})", op())))?;
        Ok(Transfer { req, bytes, descriptors: far_idx.len() })
    }

    /// `Ok(true)` once `t` completed, `Ok(false)` while in progress; never blocks.
    pub fn poll(&self, t: &Transfer) -> Result<bool, NixlCallError> {
        match self.agent.get_xfer_status(&t.req) {
            Ok(XferStatus::Success) => Ok(true),
            Ok(XferStatus::InProgress) => Ok(false),
            Err(e) => Err(call(format!("getXferStatus(READ of {} bytes)", t.bytes))(e)),
        }
    }

    /// Sends `msg` to `remote` as a NIXL notification.
    pub fn notify(&self, remote: &str, msg: &[u8]) -> Result<(), NixlCallError> {
        self.agent.send_notification(remote, msg, None).map_err(call(format!("genNotif(to '{remote}')")))
    }

    /// Notifications received since the last call: (sending agent, message).
    pub fn take_notifications(&self) -> Result<Vec<(String, String)>, NixlCallError> {
        let mut map = NotificationMap::new().map_err(call("creating a notification map"))?;
        self.agent.get_notifications(&mut map, None).map_err(call("getNotifs"))?;
        let all = map.take_notifs().map_err(call("reading notifications"))?;
        Ok(all.into_iter().flat_map(|(a, ms)| ms.into_iter().map(move |m| (a.clone(), m))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_are_nixls() {
        assert_eq!(status_name(&NixlError::BackendError), "NIXL_ERR_BACKEND");
        assert_eq!(status_name(&NixlError::InvalidParam), "NIXL_ERR_INVALID_PARAM");
        assert_eq!(status_name(&NixlError::NotFound), "NIXL_ERR_NOT_FOUND");
    }
}

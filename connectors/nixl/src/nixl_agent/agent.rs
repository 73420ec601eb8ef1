//! The NIXL agent over `nixl-sys` (feature `nixl`).

#![allow(unsafe_code)] // NIXL bindings: the agent over the NIXL C API.

use super::{NixlCallError, NixlMem, ReadPair, UCX};
use crate::nixl_lib;
use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, RegistrationHandle,
    XferDescList, XferOp, XferRequest, XferStatus,
};
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

/// A NIXL agent with the UCX backend and its registrations.
pub struct NixlAgent {
    agent: Agent,
    name: String,
    /// Memory types the UCX backend says it can move.
    mems: Vec<MemType>,
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
        Ok(NixlAgent { agent, name: name.to_owned(), mems })
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

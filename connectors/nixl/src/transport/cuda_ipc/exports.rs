//! Backend `cuda_ipc`: the device regions this process exported, by IPC handle.
//!
//! CUDA refuses to open a process's own IPC handles, so a consumer whose producer runs in
//! the same process reads that producer's regions where they are. It finds them here: a
//! handle a peer publishes that this process itself exported is read at the address this
//! process registered, within the length it registered; any other handle is opened through
//! CUDA IPC. Nothing from the wire decides which (a peer's `pid` is for messages only) and
//! no address from the wire is ever used.
//!
//! Pure bookkeeping, built without feature `cuda` so that its tests run everywhere.

use crate::metadata::{CudaIpcMetadata, RegionInfo};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// One exported region: where it is in this process, and its GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Exported {
    addr: u64,
    len: u64,
    pci_bus_id: Option<String>,
    /// Live [`Exports`] that recorded it.
    owners: usize,
}

fn table() -> MutexGuard<'static, HashMap<String, Exported>> {
    static T: OnceLock<Mutex<HashMap<String, Exported>>> = OnceLock::new();
    T.get_or_init(Mutex::default).lock().unwrap_or_else(|p| p.into_inner())
}

/// The regions one producer exported; they leave the table when it is dropped (before the
/// memory goes), so no consumer is handed the address of memory that was freed.
#[derive(Debug)]
pub struct Exports {
    handles: Vec<String>,
}

impl Exports {
    /// Records `(handle, device address, bytes)` of each region, all on the GPU with PCI bus
    /// id `pci_bus_id`.
    pub fn record(regions: Vec<(String, u64, u64)>, pci_bus_id: Option<String>) -> Exports {
        let mut t = table();
        let mut handles = Vec::with_capacity(regions.len());
        for (handle, addr, len) in regions {
            t.entry(handle.clone()).and_modify(|e| e.owners += 1).or_insert(Exported {
                addr,
                len,
                pci_bus_id: pci_bus_id.clone(),
                owners: 1,
            });
            handles.push(handle);
        }
        Exports { handles }
    }
}

impl Drop for Exports {
    fn drop(&mut self) {
        let mut t = table();
        for h in &self.handles {
            if let Some(e) = t.get_mut(h) {
                e.owners -= 1;
                if e.owners == 0 {
                    t.remove(h);
                }
            }
        }
    }
}

/// Where a consumer reads a peer's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sources {
    /// Exported by this process: read at these device addresses (one per region), on the
    /// GPU with this PCI bus id.
    Local {
        /// Device address of each region, as this process registered it.
        addrs: Vec<u64>,
        /// That GPU's PCI bus id.
        pci_bus_id: Option<String>,
    },
    /// Another process's: open every handle through CUDA IPC.
    Import,
}

/// Where to read the regions of producer `engine`, whose handshake published `m` for
/// `regions`. A handle this process exported is read where this process registered it, and
/// only if the peer claims no more bytes than were registered; a peer mixing such handles
/// with others is refused.
pub fn sources(engine: &str, m: &CudaIpcMetadata, regions: &[RegionInfo]) -> Result<Sources, String> {
    if m.handles.len() != regions.len() {
        return Err(format!(
            "producer engine '{engine}' lists {} IPC handles for {} regions",
            m.handles.len(),
            regions.len()
        ));
    }
    let t = table();
    if t.is_empty() {
        // This process exported nothing (a consumer alone): no handle is its own. Asked before
        // every load, so the handles are not hashed for nothing.
        return Ok(Sources::Import);
    }
    let mine: Vec<Option<&Exported>> = m.handles.iter().map(|h| t.get(h)).collect();
    if mine.iter().all(Option::is_none) {
        return Ok(Sources::Import);
    }
    let mut addrs = Vec::with_capacity(regions.len());
    let mut bus = None;
    for ((e, r), h) in mine.iter().zip(regions).zip(&m.handles) {
        let Some(e) = e else {
            return Err(format!(
                "producer engine '{engine}' lists IPC handles of which some this process exported and some \
                    not (region '{}', handle {}...): its handshake metadata is corrupt or forged; the peer \
                    is refused",
                r.name,
                h.get(..16).unwrap_or(h)
            ));
        };
        if r.len > e.len {
            return Err(format!(
                "producer engine '{engine}' claims region '{}' of {} bytes, but the region this process \
                    exported under that handle is {} bytes: its handshake metadata is corrupt or forged; the \
                    peer is refused",
                r.name, r.len, e.len
            ));
        }
        addrs.push(e.addr);
        bus = e.pci_bus_id.clone();
    }
    Ok(Sources::Local { addrs, pci_bus_id: bus })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &str, len: u64) -> RegionInfo {
        RegionInfo { name: name.into(), len, group: 0, shm_name: None }
    }

    /// Handshake metadata a peer sends: `handles`, plus what a lying peer might add.
    fn wire(handles: &[&str]) -> CudaIpcMetadata {
        CudaIpcMetadata {
            device: 0,
            handles: handles.iter().map(|h| h.to_string()).collect(),
            pci_bus_id: Some("0000:99:00.0".into()),
        }
    }

    #[test]
    fn a_peer_claiming_this_process_gets_its_handles_opened_never_its_addresses_used() {
        // A peer whose handshake names this process's pid and device addresses of its
        // choosing (as older producers published them), with handles this process never
        // exported.
        let mut meta = crate::metadata::sample_metadata();
        meta.pid = std::process::id();
        let json = serde_json::json!({
            "device": 0,
            "handles": ["aa".repeat(64)],
            "addrs": [0x7f00_0000_0000u64],
        });
        meta.cuda_ipc = Some(serde_json::from_value(json).unwrap());
        let m = meta.cuda_ipc.as_ref().unwrap();
        assert_eq!(sources("liar", m, &meta.regions), Ok(Sources::Import));
    }

    #[test]
    fn handles_this_process_exported_are_read_where_it_registered_them() {
        let (a, b) = ("ba".repeat(64), "bb".repeat(64));
        let exports = Exports::record(
            vec![(a.clone(), 0x1000_0000, 8192), (b.clone(), 0x2000_0000, 8192)],
            Some("0000:01:00.0".into()),
        );
        let regions = [region("layer.0", 8192), region("layer.1", 4096)];
        let got = sources("prefill-0", &wire(&[&a, &b]), &regions).unwrap();
        assert_eq!(
            got,
            Sources::Local { addrs: vec![0x1000_0000, 0x2000_0000], pci_bus_id: Some("0000:01:00.0".into()) }
        );
        // More bytes than were registered under the handle: refused.
        let e = sources("prefill-0", &wire(&[&a, &b]), &[region("layer.0", 8193), region("layer.1", 1)])
            .unwrap_err();
        assert!(e.contains("8193 bytes") && e.contains("exported under that handle is 8192"), "{e}");
        // One of ours and one not: refused.
        let other = "bc".repeat(64);
        let e = sources("prefill-0", &wire(&[&a, &other]), &regions).unwrap_err();
        assert!(e.contains("some this process exported and some not") && e.contains("layer.1"), "{e}");
        // A handle count that does not match the regions.
        assert!(sources("prefill-0", &wire(&[&a]), &regions).unwrap_err().contains("1 IPC handles for 2"));
        // Once the producer is gone, its addresses are never handed out again.
        drop(exports);
        assert_eq!(sources("prefill-0", &wire(&[&a, &b]), &regions), Ok(Sources::Import));
    }

    #[test]
    fn a_handle_recorded_twice_stays_until_both_are_dropped() {
        let h = "ca".repeat(64);
        let one = Exports::record(vec![(h.clone(), 0x3000_0000, 64)], None);
        let two = Exports::record(vec![(h.clone(), 0x3000_0000, 64)], None);
        drop(one);
        let local = sources("p", &wire(&[&h]), &[region("r", 64)]).unwrap();
        assert_eq!(local, Sources::Local { addrs: vec![0x3000_0000], pci_bus_id: None });
        drop(two);
        assert_eq!(sources("p", &wire(&[&h]), &[region("r", 64)]), Ok(Sources::Import));
    }
}

//! The engine's KV memory as a connector receives it in `register_kv_caches`
//! (ARCHITECTURE.md §4).
//!
//! A region carries a raw address, so making one is a promise about memory: only the host,
//! which owns that memory, can make it, and it does so through the one `unsafe` constructor,
//! [`KvRegion::new`], which exists only with the crate's `host` feature: a plugin built
//! against kvconnect-api cannot call it. Everything after that is safe: a region's fields are read-only, a
//! clone describes the same memory, nothing deserialises into a region, and
//! [`crate::kv_memory::KvMemory`] bounds-checks every access against the effective layout.
//! [`KvRegionSpec`] is the same description as plain data, for building, editing and sending
//! (regions cross the plugin ABI as JSON specs and the SDK turns them back into regions).

#![allow(unsafe_code)] // Declares `KvRegion::new`, the unsafe promise about memory only the host can make.

use crate::caps::MemoryKind;
use crate::ids::LayerId;
use serde::{Deserialize, Serialize};

/// What a KV region is: where it lives, how long it is, what it holds. Plain data; it
/// becomes a [`KvRegion`] only through [`KvRegion::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvRegionSpec {
    /// A name for messages (`layer.3`, `group0`).
    pub name: String,
    /// Start address in this process (host) or on the device.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where it lives.
    pub memory: MemoryKind,
    /// Device ordinal for device memory, else -1.
    pub device: i32,
    /// Layers held, in storage order.
    pub layers: Vec<LayerId>,
    /// KV cache group the region belongs to.
    pub group: u32,
    /// Blocks in the region.
    pub num_blocks: u32,
    /// Name of the POSIX shared-memory segment backing the region (`shm_open` name), when
    /// the host allocated it there so a same-host peer can map it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_name: Option<String>,
}

impl KvRegionSpec {
    /// A host-memory region over `buf` holding `layers` of KV cache group `group`, in
    /// `num_blocks` blocks. Only a description: making it a [`KvRegion`] is the promise that
    /// `buf` outlives its use.
    pub fn host(
        name: impl Into<String>,
        buf: &mut [u8],
        layers: Vec<LayerId>,
        group: u32,
        num_blocks: u32,
    ) -> KvRegionSpec {
        KvRegionSpec {
            name: name.into(),
            addr: buf.as_mut_ptr() as u64,
            len: buf.len() as u64,
            memory: MemoryKind::Host,
            device: -1,
            layers,
            group,
            num_blocks,
            shm_name: None,
        }
    }

    /// One host region per buffer in a per-layer layout: buffer `i` holds layer `i` of KV
    /// cache group 0 and is named `layer.i`.
    pub fn per_layer(buffers: &mut [Vec<u8>], num_blocks: u32) -> Vec<KvRegionSpec> {
        buffers
            .iter_mut()
            .enumerate()
            .map(|(i, b)| KvRegionSpec::host(format!("layer.{i}"), b, vec![LayerId(i as u32)], 0, num_blocks))
            .collect()
    }
}

/// A registered KV memory region: a [`KvRegionSpec`] whose memory the host vouched for.
///
/// It serialises as its spec. It has no `Deserialize`, no public fields and no setters, so
/// safe code cannot make one up or move one's address; [`KvRegion::spec`] hands out a copy
/// to edit, which takes [`KvRegion::new`] again to become a region.
///
/// Neither of these compiles:
///
/// ```compile_fail
/// let r: kvconnect_api::KvRegion = kvconnect_api::serde_json::from_str(r#"{"name":"x","addr":1,"len":8,
///     "memory":"host","device":-1,"layers":[0],"group":0,"num_blocks":1}"#).unwrap();
/// ```
///
/// ```compile_fail
/// fn grow(r: &kvconnect_api::KvRegion) -> kvconnect_api::KvRegion {
///     let mut r = r.clone();
///     r.spec.len *= 2;
///     r
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct KvRegion {
    spec: KvRegionSpec,
}

impl KvRegion {
    /// A region over the memory `spec` describes.
    ///
    /// # Safety
    /// `[spec.addr, spec.addr + spec.len)` must be memory of the kind `spec.memory` names:
    /// for host memory, readable and writable by this process; for device memory, one live
    /// allocation on GPU `spec.device`. It must stay so (not freed, not moved) for as long as
    /// this region, a clone of it or a value built from it (a `KvMemory`, a connector's copy
    /// plan) is used: a host keeps it until every connector it registered the region with
    /// has been shut down and dropped. No Rust reference into it may exist elsewhere; the
    /// engine and the connectors take turns on each block as the step protocol orders them.
    ///
    /// Only with the `host` feature: the code that owns the memory makes regions; a plugin or
    /// connector receives them.
    #[cfg(any(feature = "host", test))]
    pub unsafe fn new(spec: KvRegionSpec) -> KvRegion {
        KvRegion { spec }
    }

    /// [`KvRegion::new`] for the plugin side of the ABI, which rebuilds the regions the host
    /// sent on the host's word.
    ///
    /// # Safety
    /// As for [`KvRegion::new`].
    pub(crate) unsafe fn vouched(spec: KvRegionSpec) -> KvRegion {
        KvRegion { spec }
    }

    /// The region's description (a copy of it can be edited and vouched for again).
    pub fn spec(&self) -> &KvRegionSpec {
        &self.spec
    }

    /// A name for messages (`layer.3`, `group0`).
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Start address in this process (host) or on the device.
    pub fn addr(&self) -> u64 {
        self.spec.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.spec.len
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.spec.len == 0
    }

    /// Where it lives.
    pub fn memory(&self) -> MemoryKind {
        self.spec.memory
    }

    /// Device ordinal for device memory, else -1.
    pub fn device(&self) -> i32 {
        self.spec.device
    }

    /// Layers held, in storage order.
    pub fn layers(&self) -> &[LayerId] {
        &self.spec.layers
    }

    /// KV cache group the region belongs to.
    pub fn group(&self) -> u32 {
        self.spec.group
    }

    /// Blocks in the region.
    pub fn num_blocks(&self) -> u32 {
        self.spec.num_blocks
    }

    /// Name of the POSIX shared-memory segment backing the region, if the host allocated it
    /// there.
    pub fn shm_name(&self) -> Option<&str> {
        self.spec.shm_name.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> KvRegionSpec {
        KvRegionSpec {
            name: "layer.0".into(),
            addr: 4096,
            len: 64,
            memory: MemoryKind::Host,
            device: -1,
            layers: vec![LayerId(0)],
            group: 0,
            num_blocks: 2,
            shm_name: None,
        }
    }

    #[test]
    fn a_region_serialises_as_its_spec() {
        // SAFETY: serialised only, never dereferenced.
        let r = unsafe { KvRegion::new(spec()) };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json, serde_json::to_value(spec()).unwrap());
        assert_eq!(serde_json::from_value::<KvRegionSpec>(json).unwrap(), spec());
        assert_eq!((r.name(), r.addr(), r.len(), r.num_blocks()), ("layer.0", 4096, 64, 2));
    }
}

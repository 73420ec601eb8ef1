//! The worker half across the boundary: [`WorkerVTable`]'s entries, from which its plugin-side
//! shims and the host-side [`ForeignWorker`] are generated.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::call::*;
use super::factory::FactoryHandle;
use super::marshal::Cross;
use super::panic_guard::ExportedWorker;
use super::shim::*;
use super::vtables::{free_exported, EntryInfo, Err, Out, This};
use super::*;
use crate::{BlockId, KvRegion, LayerId, RequestId};
use crate::{ConnectorMetric, ConnectorResult, FinishedTransfers, WorkerConnector};
use core::mem::{offset_of, size_of};
use std::sync::Arc;

vtable! {
    /// Worker-half entry points; `this` is a worker handle, used from one thread at a time.
    WorkerVTable, checked WorkerFns, c "kvc_worker_vtable", free "Frees the instance.",
    plugin ExportedWorker, via handle,
    host impl WorkerConnector for ForeignWorker, unique {
        /// `regions` = JSON `Vec<KvRegionSpec>` (a list of {name, addr, len, memory, device,
        /// layers, group, num_blocks, shm_name?}): regions the host vouches for as
        /// `KvRegion::new` requires; it keeps that memory valid until it frees this instance.
        register_kv_caches(regions: &[KvRegion] as (regions: AbiBytes));
        /// The scheduler's metadata bytes for this step.
        bind_connector_meta(meta: &[u8] as (meta: AbiBytes));
        /// Starts this step's loads.
        start_load_kv();
        /// Waits for one layer's loads.
        wait_for_layer_load(layer: LayerId as (layer: u32));
        /// Saves one layer of these blocks (`block_ids`: `len` u32 block ids).
        save_kv_layer(layer: LayerId as (layer: u32),
            block_ids: &[BlockId] as (block_ids: *const u32, len: usize));
        /// Waits for this step's saves.
        wait_for_save();
        /// `finished` = `len` request ids (UTF-8); `*out` = JSON `FinishedTransfers`.
        get_finished(finished_reqs: &[RequestId] as (finished: *const AbiBytes, len: usize))
            -> json(FinishedTransfers);
        /// `*out` = JSON `Vec<BlockId>`.
        block_ids_with_load_errors() -> json(Vec<BlockId>);
        /// `*out` = JSON value, or `null` for none.
        handshake_metadata() -> json(Option<serde_json::Value>);
        /// `peer` = JSON value.
        set_peer_handshake_metadata(peer: &serde_json::Value as (peer: AbiBytes));
        /// Releases everything (the handle stays valid until `free`).
        shutdown();
    }
    optional {
        /// `*out` = JSON `Vec<ConnectorMetric>`, as the scheduler's `metrics`.
        #[since(1, 3)] #[cfg(not(feature = "abi_1_0"))]
        metrics() -> json(Vec<ConnectorMetric>), else "the connector reports no metrics" => Ok(Vec::new());
    }
    by hand {}
}

// ---------------------------------------------------------------------------------------
// The host side.

/// A plugin's worker half.
pub struct ForeignWorker {
    pub(super) factory: Arc<FactoryHandle>,
    pub(super) vt: WorkerFns,
    pub(super) handle: Handle,
}

// SAFETY: the instance is an SDK `ExportedWorker` around a `Box<dyn WorkerConnector>`
// (`Send`); we call it from one thread at a time (`&mut self`).
unsafe impl Send for ForeignWorker {}

impl Drop for ForeignWorker {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_worker` and is freed once.
        unsafe { (self.vt.free)(self.handle) };
    }
}

impl ForeignWorker {
    fn name(&self) -> &str {
        &self.factory.lib.entries().name
    }

    fn fns(&self) -> &WorkerFns {
        &self.vt
    }

    fn raw_handle(&self) -> Handle {
        self.handle
    }
}

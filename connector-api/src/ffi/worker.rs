//! The worker half across the boundary: the plugin-side shims behind [`WorkerVTable`] and
//! the host-side [`ForeignWorker`] that calls them.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::call::*;
use super::factory::FactoryHandle;
use super::shim::*;
use super::*;
use crate::sdk::ExportedWorker;
use crate::{BlockId, KvRegion, KvRegionSpec, LayerId, RequestId};
use crate::{ConnectorResult, FinishedTransfers, WorkerConnector};
use core::ffi::c_void;
use core::mem::size_of;
use std::sync::Arc;

impl WorkerVTable {
    /// The SDK's worker shims.
    pub const EXPORTED: WorkerVTable = WorkerVTable {
        struct_size: size_of::<WorkerVTable>(),
        free: Some(worker_free),
        register_kv_caches: Some(worker_register_kv_caches),
        bind_connector_meta: Some(worker_bind_connector_meta),
        start_load_kv: Some(worker_start_load_kv),
        wait_for_layer_load: Some(worker_wait_for_layer_load),
        save_kv_layer: Some(worker_save_kv_layer),
        wait_for_save: Some(worker_wait_for_save),
        get_finished: Some(worker_get_finished),
        block_ids_with_load_errors: Some(worker_block_ids_with_load_errors),
        handshake_metadata: Some(worker_handshake_metadata),
        set_peer_handshake_metadata: Some(worker_set_peer_handshake_metadata),
        shutdown: Some(worker_shutdown),
    };
}

pub(super) unsafe extern "C" fn worker_free(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: `this` came from `create_worker` (Box::into_raw) and is freed once.
        drop(unsafe { Box::from_raw(this as *mut ExportedWorker) });
    }
}

pub(super) unsafe extern "C" fn worker_register_kv_caches(
    this: *mut c_void,
    regions: AbiBytes,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    let r = read_json::<Vec<KvRegionSpec>>(w.name(), "region list", regions).and_then(|specs| {
        let regions: Vec<KvRegion> = specs
            .into_iter()
            // SAFETY: the contract of this entry point (`WorkerVTable::register_kv_caches`): the
            // host sends only regions made with `KvRegion::new`, and keeps their memory valid
            // until it frees this instance, with which the connector's views of them go.
            .map(|spec| unsafe { KvRegion::new(spec) })
            .collect();
        w.call("register_kv_caches", |c| c.register_kv_caches(&regions))
    });
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn worker_bind_connector_meta(
    this: *mut c_void,
    meta: AbiBytes,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time; `meta` is valid for the call.
    let (w, meta) = unsafe { (handle::<ExportedWorker>(this), meta.as_slice()) };
    finish(w.call("bind_connector_meta", |c| c.bind_connector_meta(meta)), err, |()| ())
}

pub(super) unsafe extern "C" fn worker_start_load_kv(this: *mut c_void, err: *mut AbiBuffer) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("start_load_kv", |c| c.start_load_kv()), err, |()| ())
}

pub(super) unsafe extern "C" fn worker_wait_for_layer_load(
    this: *mut c_void,
    layer: u32,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("wait_for_layer_load", |c| c.wait_for_layer_load(LayerId(layer))), err, |()| ())
}

pub(super) unsafe extern "C" fn worker_save_kv_layer(
    this: *mut c_void,
    layer: u32,
    block_ids: *const u32,
    len: usize,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    let blocks: &[BlockId] = if len == 0 || block_ids.is_null() {
        &[]
    } else {
        // SAFETY: the host passes `len` block ids valid for the call; `BlockId` is
        // `repr(transparent)` over u32, so the cast keeps size and alignment.
        unsafe { core::slice::from_raw_parts(block_ids as *const BlockId, len) }
    };
    finish(w.call("save_kv_layer", |c| c.save_kv_layer(LayerId(layer), blocks)), err, |()| ())
}

pub(super) unsafe extern "C" fn worker_wait_for_save(this: *mut c_void, err: *mut AbiBuffer) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("wait_for_save", |c| c.wait_for_save()), err, |()| ())
}

pub(super) unsafe extern "C" fn worker_get_finished(
    this: *mut c_void,
    finished: *const AbiBytes,
    len: usize,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    let ids: &[AbiBytes] = if len == 0 || finished.is_null() {
        &[]
    } else {
        // SAFETY: the host passes `len` request ids valid for the call.
        unsafe { core::slice::from_raw_parts(finished, len) }
    };
    // SAFETY: each id's bytes are valid for the call.
    let reqs: Vec<RequestId> = ids.iter().map(|b| RequestId(unsafe { b.to_string_lossy() })).collect();
    let r = w.call("get_finished", |c| c.get_finished(&reqs)).and_then(|f| write_json(w.name(), &f, out));
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn worker_block_ids_with_load_errors(
    this: *mut c_void,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    let r = w
        .call("block_ids_with_load_errors", |c| c.block_ids_with_load_errors())
        .and_then(|b| write_json(w.name(), &b, out));
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn worker_handshake_metadata(
    this: *mut c_void,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    let r =
        w.call("handshake_metadata", |c| c.handshake_metadata()).and_then(|m| write_json(w.name(), &m, out));
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn worker_set_peer_handshake_metadata(
    this: *mut c_void,
    peer: AbiBytes,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    let r = read_json::<serde_json::Value>(w.name(), "peer handshake metadata", peer)
        .and_then(|p| w.call("set_peer_handshake_metadata", |c| c.set_peer_handshake_metadata(&p)));
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn worker_shutdown(this: *mut c_void, err: *mut AbiBuffer) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("shutdown", |c| c.shutdown()), err, |()| ())
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
}

impl WorkerConnector for ForeignWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        // The regions' memory outlives this instance (`KvRegion::new`'s contract): the promise
        // the plugin side's SDK relies on when it turns these specs back into regions.
        let r = to_json(self.name(), &regions)?;
        let (f, h) = (self.vt.register_kv_caches, self.handle);
        // SAFETY: a live instance used from this thread only; bytes live across the call.
        call_status(|| self.name(), |err| unsafe { f(h, bytes(&r), err) })
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        let (f, h) = (self.vt.bind_connector_meta, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, bytes(meta), err) })
    }

    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        let (f, h) = (self.vt.start_load_kv, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, err) })
    }

    fn wait_for_layer_load(&mut self, layer: LayerId) -> ConnectorResult<()> {
        let (f, h) = (self.vt.wait_for_layer_load, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, layer.0, err) })
    }

    fn save_kv_layer(&mut self, layer: LayerId, block_ids: &[BlockId]) -> ConnectorResult<()> {
        let (f, h) = (self.vt.save_kv_layer, self.handle);
        // SAFETY: as above; `BlockId` is `repr(transparent)` over u32, so the slice is a valid
        // array of `len` u32 for the call.
        call_status(
            || self.name(),
            |err| unsafe { f(h, layer.0, block_ids.as_ptr() as *const u32, block_ids.len(), err) },
        )
    }

    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        let (f, h) = (self.vt.wait_for_save, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, err) })
    }

    fn get_finished(&mut self, finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        let ids: Vec<AbiBytes> = finished_reqs.iter().map(|r| bytes(r.0.as_bytes())).collect();
        let (f, h) = (self.vt.get_finished, self.handle);
        // SAFETY: as above; `ids` and the strings it borrows live across the call.
        call_json(
            || self.name(),
            "get_finished",
            |out, err| unsafe { f(h, ids.as_ptr(), ids.len(), out, err) },
        )
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        let (f, h) = (self.vt.block_ids_with_load_errors, self.handle);
        // SAFETY: as above.
        call_json(|| self.name(), "block_ids_with_load_errors", |out, err| unsafe { f(h, out, err) })
    }

    fn handshake_metadata(&mut self) -> ConnectorResult<Option<serde_json::Value>> {
        let (f, h) = (self.vt.handshake_metadata, self.handle);
        // SAFETY: as above.
        call_json(|| self.name(), "handshake_metadata", |out, err| unsafe { f(h, out, err) })
    }

    fn set_peer_handshake_metadata(&mut self, peer: &serde_json::Value) -> ConnectorResult<()> {
        let p = to_json(self.name(), peer)?;
        let (f, h) = (self.vt.set_peer_handshake_metadata, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, bytes(&p), err) })
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        let (f, h) = (self.vt.shutdown, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, err) })
    }
}

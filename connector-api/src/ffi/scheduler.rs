//! The scheduler half across the boundary: the plugin-side shims behind
//! [`SchedulerVTable`] and the host-side [`ForeignScheduler`] that calls them.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::call::*;
use super::factory::FactoryHandle;
use super::shim::*;
use super::*;
use crate::sdk::ExportedScheduler;
use crate::{BlocksPerGroup, Request, StepInfo};
use crate::{ConnectorResult, KvEvent, MatchResult, RequestFinished, SchedulerConnector};
use core::ffi::c_void;
use core::mem::size_of;
use std::sync::Arc;

impl SchedulerVTable {
    /// The SDK's scheduler shims.
    pub const EXPORTED: SchedulerVTable = SchedulerVTable {
        struct_size: size_of::<SchedulerVTable>(),
        free: Some(scheduler_free),
        get_num_new_matched_tokens: Some(scheduler_get_num_new_matched_tokens),
        update_state_after_alloc: Some(scheduler_update_state_after_alloc),
        build_connector_meta: Some(scheduler_build_connector_meta),
        request_finished: Some(scheduler_request_finished),
        take_events: Some(scheduler_take_events),
    };
}

pub(super) unsafe extern "C" fn scheduler_free(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: `this` came from `create_scheduler` (Box::into_raw) and is freed once.
        drop(unsafe { Box::from_raw(this as *mut ExportedScheduler) });
    }
}

pub(super) unsafe extern "C" fn scheduler_get_num_new_matched_tokens(
    this: *mut c_void,
    req: AbiBytes,
    num_computed: u64,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live scheduler handle, one thread at a time.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r = read_json::<Request>(s.name(), "request", req)
        .and_then(|req| {
            s.call("get_num_new_matched_tokens", |c| {
                c.get_num_new_matched_tokens(&req, num_computed as usize)
            })
        })
        .and_then(|m| write_json(s.name(), &m, out));
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn scheduler_update_state_after_alloc(
    this: *mut c_void,
    req: AbiBytes,
    blocks: AbiBytes,
    num_external_tokens: u64,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live scheduler handle, one thread at a time.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r = (|| {
        let req: Request = read_json(s.name(), "request", req)?;
        let blocks: BlocksPerGroup = read_json(s.name(), "block list", blocks)?;
        s.call("update_state_after_alloc", |c| {
            c.update_state_after_alloc(&req, &blocks, num_external_tokens as usize)
        })
    })();
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn scheduler_build_connector_meta(
    this: *mut c_void,
    step: AbiBytes,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live scheduler handle, one thread at a time.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r = read_json::<StepInfo>(s.name(), "step", step)
        .and_then(|step| s.call("build_connector_meta", |c| c.build_connector_meta(&step)));
    finish(r, err, |bytes| write_buf(out, bytes))
}

pub(super) unsafe extern "C" fn scheduler_request_finished(
    this: *mut c_void,
    req: AbiBytes,
    blocks: AbiBytes,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live scheduler handle, one thread at a time.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r = (|| {
        let req: Request = read_json(s.name(), "request", req)?;
        let blocks: BlocksPerGroup = read_json(s.name(), "block list", blocks)?;
        let f = s.call("request_finished", |c| c.request_finished(&req, &blocks))?;
        write_json(s.name(), &f, out)
    })();
    finish(r, err, |()| ())
}

pub(super) unsafe extern "C" fn scheduler_take_events(
    this: *mut c_void,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live scheduler handle, one thread at a time.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r = s.call("take_events", |c| c.take_events()).and_then(|ev| write_json(s.name(), &ev, out));
    finish(r, err, |()| ())
}

// ---------------------------------------------------------------------------------------
// The host side.

/// A plugin's scheduler half.
pub struct ForeignScheduler {
    pub(super) factory: Arc<FactoryHandle>,
    pub(super) vt: SchedulerFns,
    pub(super) handle: Handle,
}

// SAFETY: the instance is an SDK `ExportedScheduler` around a `Box<dyn SchedulerConnector>`
// (`Send`); we call it from one thread at a time (`&mut self`).
unsafe impl Send for ForeignScheduler {}

impl Drop for ForeignScheduler {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_scheduler` and is freed once.
        unsafe { (self.vt.free)(self.handle) };
    }
}

impl ForeignScheduler {
    fn name(&self) -> &str {
        &self.factory.lib.entries().name
    }
}

impl SchedulerConnector for ForeignScheduler {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        let r = to_json(self.name(), req)?;
        let (f, h) = (self.vt.get_num_new_matched_tokens, self.handle);
        // SAFETY: a live instance used from this thread only; bytes live across the call.
        call_json(
            || self.name(),
            "get_num_new_matched_tokens",
            |out, err| unsafe { f(h, bytes(&r), num_computed as u64, out, err) },
        )
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        let r = to_json(self.name(), req)?;
        let b = to_json(self.name(), blocks)?;
        let (f, h) = (self.vt.update_state_after_alloc, self.handle);
        // SAFETY: as above.
        call_status(
            || self.name(),
            |err| unsafe { f(h, bytes(&r), bytes(&b), num_external_tokens as u64, err) },
        )
    }

    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        let s = to_json(self.name(), step)?;
        let (f, h) = (self.vt.build_connector_meta, self.handle);
        // SAFETY: as above.
        let out = call_out(|| self.name(), |out, err| unsafe { f(h, bytes(&s), out, err) })?;
        Ok(out.as_bytes().to_vec())
    }

    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        let r = to_json(self.name(), req)?;
        let b = to_json(self.name(), blocks)?;
        let (f, h) = (self.vt.request_finished, self.handle);
        // SAFETY: as above.
        call_json(
            || self.name(),
            "request_finished",
            |out, err| unsafe { f(h, bytes(&r), bytes(&b), out, err) },
        )
    }

    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        let (f, h) = (self.vt.take_events, self.handle);
        // SAFETY: as above.
        call_json(|| self.name(), "take_events", |out, err| unsafe { f(h, out, err) })
    }
}

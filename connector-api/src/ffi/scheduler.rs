//! The scheduler half across the boundary: [`SchedulerVTable`]'s entries, from which its
//! plugin-side shims and the host-side [`ForeignScheduler`] are generated.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::call::*;
use super::factory::FactoryHandle;
use super::marshal::Cross;
use super::panic_guard::ExportedScheduler;
use super::shim::*;
use super::vtables::{free_exported, EntryInfo, Err, Out, This};
use super::*;
use crate::{BlocksPerGroup, Request, StepInfo};
use crate::{ConnectorResult, KvEvent, MatchResult, RequestFinished, SchedulerConnector};
use core::mem::{offset_of, size_of};
use std::sync::Arc;

vtable! {
    /// Scheduler-half entry points; `this` is a scheduler handle, used from one thread at a
    /// time.
    SchedulerVTable, checked SchedulerFns, c "kvc_scheduler_vtable", free "Frees the instance.",
    plugin ExportedScheduler, via handle,
    host impl SchedulerConnector for ForeignScheduler, unique {
        /// `req` = JSON `Request`; `*out` = JSON `MatchResult`.
        get_num_new_matched_tokens(req: &Request as (req: AbiBytes), num_computed: usize as (num_computed: u64))
            -> json(MatchResult);
        /// `req` = JSON `Request`, `blocks` = JSON `BlocksPerGroup`.
        update_state_after_alloc(req: &Request as (req: AbiBytes), blocks: &BlocksPerGroup as (blocks: AbiBytes),
            num_external_tokens: usize as (num_external_tokens: u64));
        /// `step` = JSON `StepInfo`; `*out` = the metadata bytes, as the connector made them.
        build_connector_meta(step: &StepInfo as (step: AbiBytes)) -> bytes;
        /// `req`, `blocks` as above; `*out` = JSON `RequestFinished`.
        request_finished(req: &Request as (req: AbiBytes), blocks: &BlocksPerGroup as (blocks: AbiBytes))
            -> json(RequestFinished);
        /// `*out` = JSON `Vec<KvEvent>`.
        take_events() -> json(Vec<KvEvent>);
    }
    optional {}
    by hand {}
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

    fn fns(&self) -> &SchedulerFns {
        &self.vt
    }

    fn raw_handle(&self) -> Handle {
        self.handle
    }
}

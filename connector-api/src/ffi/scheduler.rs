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
use crate::kv_events::KvEventBefore;
use crate::{BlocksPerGroup, Request, StepInfo};
use crate::{ConnectorMetric, ConnectorResult, KvEvent, MatchResult, RequestFinished, SchedulerConnector};
use core::mem::{offset_of, size_of};
use std::sync::Arc;

vtable! {
    /// Scheduler-half entry points; `this` is a scheduler handle, used from one thread at a
    /// time.
    SchedulerVTable, checked SchedulerFns, c "kvc_scheduler_vtable", free "Frees the instance.",
    plugin ExportedScheduler, via handle,
    host impl SchedulerConnector for ForeignScheduler, unique {
        /// `req` = JSON `Request`; `*out` = JSON `MatchResult`.
        get_num_new_matched_tokens(req: &Request as (req: AbiBytes),
            num_computed: usize as (num_computed: u64)) -> json(MatchResult);
        /// `req` = JSON `Request`, `blocks` = JSON `BlocksPerGroup`.
        update_state_after_alloc(req: &Request as (req: AbiBytes),
            blocks: &BlocksPerGroup as (blocks: AbiBytes),
            num_external_tokens: usize as (num_external_tokens: u64));
        /// `step` = JSON `StepInfo`; `*out` = the metadata bytes, as the connector made them.
        build_connector_meta(step: &StepInfo as (step: AbiBytes)) -> bytes;
        /// `req`, `blocks` as above; `*out` = JSON `RequestFinished`.
        request_finished(req: &Request as (req: AbiBytes), blocks: &BlocksPerGroup as (blocks: AbiBytes))
            -> json(RequestFinished);
        /// `*out` = JSON events in the shape before media (`[{"Stored": {"hashes": [..],
        /// "tier": ".."}}]`, `Removed` alike; no clears). A host calls it only when the plugin
        /// lacks `take_kv_events`.
        take_events() -> json(Vec<KvEvent>), by scheduler_take_events;
    }
    optional {
        /// `*out` = JSON `Vec<KvEvent>`: vLLM's event model (`BlockStored` with parent, tokens,
        /// block size and medium; `BlockRemoved` with medium; `AllBlocksCleared`).
        #[since(1, 2)] #[cfg(not(feature = "abi_1_0"))]
        take_kv_events() -> json(Vec<KvEvent>), else "the host calls `take_events`",
            by scheduler_take_kv_events;
        /// `*out` = JSON `Vec<ConnectorMetric>`: what the connector counts for the host's
        /// `/metrics` (a list of {name, help, kind: "counter"|"gauge", labels: [[name, value]],
        /// value}).
        #[since(1, 3)] #[cfg(not(feature = "abi_1_0"))]
        metrics() -> json(Vec<ConnectorMetric>), else "the connector reports no metrics" => Ok(Vec::new());
    }
    by hand {
        fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
            #[cfg(not(feature = "abi_1_0"))]
            if let Some(f) = self.vt.take_kv_events {
                return foreign_call!(self, take_kv_events, f, [], [json(Vec<KvEvent>)]);
            }
            // A plugin before 1.2 writes the shape before media, which `KvEvent` also reads.
            foreign_call!(self, take_events, self.vt.take_events, [], [json(Vec<KvEvent>)])
        }
    }
}

/// `take_events`: the connector's events in the shape before media, for a host before 1.2.
unsafe extern "C" fn scheduler_take_events(this: This, out: Out, err: Err) -> Status {
    // SAFETY: a live scheduler handle of this plugin's, used as the vtable documents.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r = s.call("take_events", |c| c.take_events()).and_then(|events| {
        let before: Vec<KvEventBefore> = events.iter().filter_map(KvEventBefore::of).collect();
        write_json(s.name(), &before, out)
    });
    finish(r, err, |()| ())
}

/// `take_kv_events`: the connector's events as they are.
#[cfg(not(feature = "abi_1_0"))]
unsafe extern "C" fn scheduler_take_kv_events(this: This, out: Out, err: Err) -> Status {
    // SAFETY: a live scheduler handle of this plugin's, used as the vtable documents.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r =
        s.call("take_kv_events", |c| c.take_events()).and_then(|events| write_json(s.name(), &events, out));
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

    fn fns(&self) -> &SchedulerFns {
        &self.vt
    }

    fn raw_handle(&self) -> Handle {
        self.handle
    }
}

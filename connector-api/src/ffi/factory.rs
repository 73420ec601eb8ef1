//! The factory across the boundary: [`FactoryVTable`]'s entries, from which its plugin-side
//! shims and the host-side [`ForeignFactory`] are generated, and the entries written by hand:
//! `factory_new`, `info` (the host asks once, at load, and keeps the answer) and the two that
//! make instances (their `*out` is a new handle the host wraps, not a value).

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::call::*;
use super::marshal::Cross;
use super::panic_guard::ExportedFactory;
use super::shim::*;
use super::vtables::{free_exported, EntryInfo, Err, Out, This};
use super::*;
use crate::negotiate::ChildCaps;
use crate::{
    Capabilities, ConnectorFactory, ConnectorInfo, ConnectorResult, SchedulerConnector, WorkerConnector,
};
use crate::{ConnectorContext, KvTransferConfig, ModelSpec};
use core::ffi::c_void;
use core::mem::{offset_of, size_of};
use std::sync::Arc;

/// `create_scheduler` and `create_worker`.
type CreateFn = unsafe extern "C" fn(*mut c_void, AbiBytes, *mut *mut c_void, *mut AbiBuffer) -> Status;

vtable! {
    /// The factory's entry points. `this` is the handle `factory_new` returned; a factory may
    /// be called from any thread.
    FactoryVTable, checked FactoryFns, c "kvc_factory_vtable", free "Frees the factory.",
    plugin ExportedFactory, via shared,
    host impl ConnectorFactory for ForeignFactory, shared {
        /// `*out` = JSON `ConnectorInfo`.
        info() -> json(ConnectorInfo), by factory_info;
        /// `config` = JSON `KvTransferConfig`, `model` = JSON `ModelSpec` or empty; `*out` = JSON
        /// `Capabilities`.
        capabilities(config: &KvTransferConfig as (config: AbiBytes),
            model: Option<&ModelSpec> as (model: AbiBytes)) -> json(Capabilities);
        /// `ctx` = JSON `ConnectorContext`; `*out` = the scheduler handle.
        create_scheduler(ctx: &ConnectorContext as (ctx: AbiBytes)) -> handle, by factory_create_scheduler;
        /// `ctx` = JSON `ConnectorContext`; `*out` = the worker handle.
        create_worker(ctx: &ConnectorContext as (ctx: AbiBytes)) -> handle, by factory_create_worker;
    }
    optional {
        /// For a composite: `config`, `model` as for `capabilities`; `*out` = JSON
        /// `Option<Vec<ChildCaps>>` (a list of {name, version, caps}), `null` for a plain connector.
        #[since(1, 1)] #[cfg(not(feature = "abi_1_0"))]
        child_capabilities(config: &KvTransferConfig as (config: AbiBytes),
            model: Option<&ModelSpec> as (model: AbiBytes))
            -> json(Option<Vec<ChildCaps>>), else "the connector has no children" => Ok(None);
    }
    by hand {
        fn info(&self) -> ConnectorInfo {
            self.info.clone()
        }

        fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
            let handle = self.create_instance("create_scheduler", self.fns().create_scheduler, ctx)?;
            Ok(Box::new(ForeignScheduler {
                factory: self.inner.clone(),
                vt: self.inner.lib.entries().scheduler_vt,
                handle,
            }))
        }

        fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
            let handle = self.create_instance("create_worker", self.fns().create_worker, ctx)?;
            Ok(Box::new(ForeignWorker {
                factory: self.inner.clone(),
                vt: self.inner.lib.entries().worker_vt,
                handle,
            }))
        }
    }
}

pub(super) unsafe extern "C" fn factory_new<M: MakeFactory>(
    out: *mut *mut c_void,
    err: *mut AbiBuffer,
) -> Status {
    let r = ExportedFactory::new(M::NAME, M::make);
    finish(r, err, |f| {
        if !out.is_null() {
            // SAFETY: valid out-parameter from the host.
            unsafe { out.write(Box::into_raw(Box::new(f)) as *mut c_void) };
        }
    })
}

pub(super) unsafe extern "C" fn factory_info(
    this: *mut c_void,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live factory handle; factories are Sync, so a shared borrow is enough.
    let f = unsafe { &*(this as *const ExportedFactory) };
    finish(f.call("info", |c| Ok(c.info())).and_then(|i| write_json(f.name(), &i, out)), err, |()| ())
}

/// The shared body of `create_scheduler` and `create_worker`: `ctx` = JSON
/// `ConnectorContext`; `*out` = the new instance, boxed.
///
/// # Safety
/// `this` is a live factory handle; `out` and `err` are valid out-parameters (or null).
unsafe fn create_instance<T>(
    this: *mut c_void,
    ctx: AbiBytes,
    out: *mut *mut c_void,
    err: *mut AbiBuffer,
    make: impl FnOnce(&ExportedFactory, &ConnectorContext) -> Result<T, ConnectorError>,
) -> Status {
    // SAFETY: a live factory handle (the caller's contract); factories are Sync.
    let f = unsafe { &*(this as *const ExportedFactory) };
    let r = read_json::<ConnectorContext>(f.name(), "connector context", ctx).and_then(|ctx| make(f, &ctx));
    finish(r, err, |instance| {
        if !out.is_null() {
            // SAFETY: valid out-parameter from the host.
            unsafe { out.write(Box::into_raw(Box::new(instance)) as *mut c_void) };
        }
    })
}

pub(super) unsafe extern "C" fn factory_create_scheduler(
    this: *mut c_void,
    ctx: AbiBytes,
    out: *mut *mut c_void,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: the host's arguments, as the entry requires.
    unsafe { create_instance(this, ctx, out, err, |f, ctx| f.create_scheduler(ctx)) }
}

pub(super) unsafe extern "C" fn factory_create_worker(
    this: *mut c_void,
    ctx: AbiBytes,
    out: *mut *mut c_void,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: as above.
    unsafe { create_instance(this, ctx, out, err, |f, ctx| f.create_worker(ctx)) }
}

// ---------------------------------------------------------------------------------------
// The host side.

pub(super) struct FactoryHandle {
    pub(super) lib: Arc<dyn PluginCode>,
    handle: Handle,
}

// SAFETY: the handle is an SDK `ExportedFactory` (or a C plugin's equivalent), which the ABI
// requires to be usable from any thread concurrently (`ConnectorFactory: Send + Sync`).
unsafe impl Send for FactoryHandle {}
// SAFETY: as above.
unsafe impl Sync for FactoryHandle {}

impl Drop for FactoryHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from `factory_new` and is freed once, after every instance
        // (which hold an Arc to this) is gone.
        unsafe { (self.lib.entries().factory_vt.free)(self.handle) };
    }
}

/// A plugin's factory, seen through the safe trait.
pub struct ForeignFactory {
    inner: Arc<FactoryHandle>,
    info: ConnectorInfo,
}

impl ForeignFactory {
    /// Makes the plugin's factory through `lib`'s entries.
    ///
    /// # Safety
    /// `lib.entries()` must be the checked entries of a plugin library (`FactoryFns` and the
    /// others: every entry the host calls present and of the declared type) that `lib` keeps
    /// mapped for as long as it lives; every object made here holds `lib`.
    pub unsafe fn create(lib: Arc<dyn PluginCode>) -> ConnectorResult<ForeignFactory> {
        let mut handle: Handle = std::ptr::null_mut();
        let factory_new = lib.entries().factory_new;
        // SAFETY: a checked entry; both out-parameters are valid.
        call_status(|| &lib.entries().name, |err| unsafe { factory_new(&mut handle, err) })?;
        if handle.is_null() {
            return Err(ConnectorError::Other {
                connector: lib.entries().name.clone(),
                message: "factory_new returned no factory".into(),
            });
        }
        let inner = Arc::new(FactoryHandle { lib, handle });
        let info_fn = inner.lib.entries().factory_vt.info;
        // SAFETY: a live factory handle; valid out-parameters.
        let info = call_json(
            || &inner.lib.entries().name,
            "info",
            |out, err| unsafe { info_fn(inner.handle, out, err) },
        )?;
        Ok(ForeignFactory { inner, info })
    }

    /// The library it comes from.
    pub fn library(&self) -> &Arc<dyn PluginCode> {
        &self.inner.lib
    }

    fn name(&self) -> &str {
        &self.inner.lib.entries().name
    }

    /// Calls `create_scheduler` or `create_worker` (`method`, entry `f`); returns the handle.
    fn create_instance(&self, method: &str, f: CreateFn, ctx: &ConnectorContext) -> ConnectorResult<Handle> {
        let c = to_json(|| self.name(), ctx)?;
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: a live factory handle; valid out-parameters; bytes live across the call.
        call_status(|| self.name(), |err| unsafe { f(self.inner.handle, bytes(&c), &mut h, err) })?;
        if h.is_null() {
            return Err(ConnectorError::Other {
                connector: self.name().into(),
                message: format!("{method} returned no instance"),
            });
        }
        Ok(h)
    }

    fn fns(&self) -> &FactoryFns {
        &self.inner.lib.entries().factory_vt
    }

    fn raw_handle(&self) -> Handle {
        self.inner.handle
    }
}

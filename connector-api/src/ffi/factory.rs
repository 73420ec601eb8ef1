//! The factory across the boundary: the plugin-side shims behind [`FactoryVTable`] and the
//! host-side [`ForeignFactory`] that calls them.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::call::*;
use super::shim::*;
use crate::negotiate::ChildCaps;
use crate::{
    Capabilities, ConnectorFactory, ConnectorInfo, ConnectorResult, SchedulerConnector, WorkerConnector,
};
use std::sync::Arc;

/// `create_scheduler` and `create_worker`.
type CreateFn = unsafe extern "C" fn(*mut c_void, AbiBytes, *mut *mut c_void, *mut AbiBuffer) -> Status;
use super::*;
use crate::sdk::ExportedFactory;
use crate::{ConnectorContext, KvTransferConfig, ModelSpec};
use core::ffi::c_void;
use core::mem::size_of;

impl FactoryVTable {
    /// The SDK's factory shims.
    pub const EXPORTED: FactoryVTable = FactoryVTable {
        struct_size: size_of::<FactoryVTable>(),
        free: Some(factory_free),
        info: Some(factory_info),
        capabilities: Some(factory_query::<CapabilitiesQuery>),
        create_scheduler: Some(factory_create_scheduler),
        create_worker: Some(factory_create_worker),
        #[cfg(not(feature = "abi_1_0"))]
        child_capabilities: Some(factory_query::<ChildCapabilitiesQuery>),
    };
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

pub(super) unsafe extern "C" fn factory_free(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: `this` came from `factory_new` (Box::into_raw) and the host frees it once.
        drop(unsafe { Box::from_raw(this as *mut ExportedFactory) });
    }
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

/// A factory query that takes a config and a model and answers JSON: one shim,
/// [`factory_query`], serves each.
pub(super) trait FactoryQuery {
    const METHOD: &'static str;
    type Answer: serde::Serialize;
    fn ask(
        c: &dyn crate::connector::ConnectorFactory,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> Result<Self::Answer, ConnectorError>;
}

/// `FactoryVTable::capabilities`.
pub(super) struct CapabilitiesQuery;
impl FactoryQuery for CapabilitiesQuery {
    const METHOD: &'static str = "capabilities";
    type Answer = crate::Capabilities;
    fn ask(
        c: &dyn crate::connector::ConnectorFactory,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> Result<Self::Answer, ConnectorError> {
        c.capabilities(config, model)
    }
}

/// `FactoryVTable::child_capabilities`.
#[cfg(not(feature = "abi_1_0"))]
pub(super) struct ChildCapabilitiesQuery;
#[cfg(not(feature = "abi_1_0"))]
impl FactoryQuery for ChildCapabilitiesQuery {
    const METHOD: &'static str = "child_capabilities";
    type Answer = Option<Vec<crate::negotiate::ChildCaps>>;
    fn ask(
        c: &dyn crate::connector::ConnectorFactory,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> Result<Self::Answer, ConnectorError> {
        c.child_capabilities(config, model)
    }
}

/// `config` = JSON `KvTransferConfig`, `model` = JSON `ModelSpec` or empty for none; `*out` =
/// the answer of `Q`, JSON.
pub(super) unsafe extern "C" fn factory_query<Q: FactoryQuery>(
    this: *mut c_void,
    config: AbiBytes,
    model: AbiBytes,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live factory handle; factories are Sync.
    let f = unsafe { &*(this as *const ExportedFactory) };
    let r = (|| {
        let config: KvTransferConfig = read_json(f.name(), "kv-transfer-config", config)?;
        let model: Option<ModelSpec> =
            if model.len == 0 { None } else { Some(read_json(f.name(), "model spec", model)?) };
        let answer = f.call(Q::METHOD, |c| Q::ask(c, &config, model.as_ref()))?;
        write_json(f.name(), &answer, out)
    })();
    finish(r, err, |()| ())
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
        let c = to_json(self.name(), ctx)?;
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

    /// Runs a capability-style query: config and model in, JSON out.
    fn query<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        f: FactoryQueryFn,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<T> {
        let c = to_json(self.name(), config)?;
        let m = match model {
            Some(m) => to_json(self.name(), m)?,
            None => Vec::new(),
        };
        // SAFETY: a live factory handle; argument bytes live across the call.
        call_json(
            || self.name(),
            method,
            |out, err| unsafe { f(self.inner.handle, bytes(&c), bytes(&m), out, err) },
        )
    }
}

impl ConnectorFactory for ForeignFactory {
    fn info(&self) -> ConnectorInfo {
        self.info.clone()
    }

    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        self.query("capabilities", self.inner.lib.entries().factory_vt.capabilities, config, model)
    }

    fn child_capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Option<Vec<ChildCaps>>> {
        #[cfg(not(feature = "abi_1_0"))]
        match self.inner.lib.entries().factory_vt.child_capabilities {
            Some(f) => self.query("child_capabilities", f, config, model),
            // A 1.0 plugin: the entry did not exist, so it is not a composite.
            None => Ok(None),
        }
        // A host of ABI 1.0 knows no such entry.
        #[cfg(feature = "abi_1_0")]
        {
            let _ = (config, model);
            Ok(None)
        }
    }

    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        let handle = self.create_instance(
            "create_scheduler",
            self.inner.lib.entries().factory_vt.create_scheduler,
            ctx,
        )?;
        Ok(Box::new(ForeignScheduler {
            factory: self.inner.clone(),
            vt: self.inner.lib.entries().scheduler_vt,
            handle,
        }))
    }

    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        let handle =
            self.create_instance("create_worker", self.inner.lib.entries().factory_vt.create_worker, ctx)?;
        Ok(Box::new(ForeignWorker {
            factory: self.inner.clone(),
            vt: self.inner.lib.entries().worker_vt,
            handle,
        }))
    }
}

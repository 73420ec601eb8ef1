//! The versioned C ABI between a host and a plugin library: the only `unsafe` surface on the
//! plugin side. ARCHITECTURE.md §3 states its rules.
//!
//! A plugin exports one symbol, [`ENTRY_SYMBOL`], returning `&'static PluginDescriptor`. The
//! descriptor's first fields (magic, ABI version, struct size, layout fingerprint, plugin name
//! and version, SDK and rustc versions) never move,
//! so any host can read them from any plugin and refuse it with a clear message. Then come
//! the plugin's name and versions, its entry points and pointers to three vtables (factory,
//! scheduler half, worker half). Every vtable starts with its own `struct_size`; new entries
//! are only ever appended, as nullable function pointers, in a new minor version.
//!
//! Conventions every entry point follows:
//! * it returns a [`Status`]: [`status::OK`] or the kind of [`ConnectorError`], with the
//!   error itself (JSON) in the `err` buffer;
//! * a buffer is freed by the side that allocated it, through the free function it carries;
//! * setup-time values (configs, capabilities, model, context, regions, handshake metadata)
//!   cross as JSON bytes; per-step calls take `repr(C)` slices;
//! * no Rust std type crosses, and no panic: the plugin side catches every panic
//!   (`sdk`), turns it into [`status::PANICKED`] and poisons the instance.
//!
//! `include/kvconnect.h` is the same ABI for C and C++, written from these definitions by
//! [`c_header`]; a test keeps the checked-in file equal to it and checks its sizes and offsets.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use crate::connector::{BlocksPerGroup, ConnectorContext, Request, StepInfo};
use crate::error::ConnectorError;
use crate::ids::{BlockId, LayerId, RequestId};
use crate::region::{KvRegion, KvRegionSpec};
use crate::sdk::{self, ExportedFactory, ExportedScheduler, ExportedWorker};
use crate::{KvTransferConfig, ModelSpec};
use core::ffi::c_void;
use core::mem::{offset_of, size_of};

mod header;
mod json_values;
mod vtables;
pub use header::c_header;
pub use json_values::{json_values, JsonValue};
pub use vtables::{
    CType, EntryInfo, FactoryFns, FactoryVTable, SchedulerFns, SchedulerVTable, WorkerFns, WorkerVTable,
};

/// `kvconnect_plugin_entry`: the one symbol a plugin exports.
pub const ENTRY_SYMBOL: &str = "kvconnect_plugin_entry";
/// The first field of every descriptor: "KVCONNEC" read as a little-endian u64.
pub const ABI_MAGIC: u64 = u64::from_le_bytes(*b"KVCONNEC");
/// Breaking changes bump the major; a host refuses a plugin of another major.
pub const ABI_MAJOR: u16 = 1;
/// Additions (entries appended to a vtable) bump the minor; a host accepts a newer minor.
/// 1.1 appended `FactoryVTable::child_capabilities`.
#[cfg(not(feature = "abi_1_0"))]
pub const ABI_MINOR: u16 = 1;
/// The minor as 1.0 defined the ABI (the test-only `abi_1_0` feature: see Cargo.toml).
#[cfg(feature = "abi_1_0")]
pub const ABI_MINOR: u16 = 0;
/// The kvconnect-api version this ABI comes from (what to rebuild a plugin against).
pub const SDK_VERSION: &str = env!("CARGO_PKG_VERSION");
/// The compiler that built this copy of the SDK (`rustc -V`), for messages only.
pub const RUSTC_VERSION: &str = env!("KVCONNECT_RUSTC_VERSION");

/// The return value of every entry point.
pub type Status = i32;

/// Status codes: 0 is success, the others name the kind of [`ConnectorError`].
pub mod status {
    use super::Status;
    /// Success.
    pub const OK: Status = 0;
    /// `ConnectorError::NotImplemented`.
    pub const NOT_IMPLEMENTED: Status = 1;
    /// `ConnectorError::InvalidConfig`.
    pub const INVALID_CONFIG: Status = 2;
    /// `ConnectorError::InvalidArgument`.
    pub const INVALID_ARGUMENT: Status = 3;
    /// `ConnectorError::Poisoned`.
    pub const POISONED: Status = 4;
    /// `ConnectorError::Panicked`.
    pub const PANICKED: Status = 5;
    /// `ConnectorError::Io`.
    pub const IO: Status = 6;
    /// `ConnectorError::Other`.
    pub const OTHER: Status = 7;
}

/// The status code for an error.
pub fn status_of(e: &ConnectorError) -> Status {
    match e {
        ConnectorError::NotImplemented { .. } => status::NOT_IMPLEMENTED,
        ConnectorError::InvalidConfig { .. } => status::INVALID_CONFIG,
        ConnectorError::InvalidArgument { .. } => status::INVALID_ARGUMENT,
        ConnectorError::Poisoned { .. } => status::POISONED,
        ConnectorError::Panicked { .. } => status::PANICKED,
        ConnectorError::Io { .. } => status::IO,
        ConnectorError::Other { .. } => status::OTHER,
    }
}

/// Borrowed bytes (or UTF-8 text), valid for the duration of one call unless said otherwise.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AbiBytes {
    /// First byte; may be null when `len` is 0.
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl AbiBytes {
    /// Empty bytes.
    pub const EMPTY: AbiBytes = AbiBytes { ptr: core::ptr::null(), len: 0 };

    /// Borrows a static string (the descriptor's names).
    pub const fn from_static(s: &'static str) -> AbiBytes {
        AbiBytes { ptr: s.as_ptr(), len: s.len() }
    }

    /// Borrows bytes for one call.
    #[inline]
    pub fn from_slice(b: &[u8]) -> AbiBytes {
        AbiBytes { ptr: b.as_ptr(), len: b.len() }
    }

    /// The bytes.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that stay valid and unchanged for `'a`
    /// (or `len` must be 0).
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        if self.len == 0 || self.ptr.is_null() {
            &[]
        } else {
            // SAFETY: the caller guarantees ptr/len describe valid bytes for 'a.
            unsafe { core::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    /// The bytes as text; invalid UTF-8 is replaced, since these strings only feed messages
    /// and names.
    ///
    /// # Safety
    /// As for [`AbiBytes::as_slice`].
    pub unsafe fn to_string_lossy(&self) -> String {
        // SAFETY: forwarded to the caller.
        String::from_utf8_lossy(unsafe { self.as_slice() }).into_owned()
    }
}

/// Bytes owned by the side that allocated them, carrying the function that frees them.
#[repr(C)]
#[derive(Debug)]
pub struct AbiBuffer {
    /// First byte (null when empty).
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
    /// Allocated capacity, for the allocator's own use.
    pub cap: usize,
    /// Frees the buffer; called exactly once by whoever received it. Null when empty.
    pub free: Option<unsafe extern "C" fn(ptr: *mut u8, len: usize, cap: usize)>,
}

impl AbiBuffer {
    /// An empty buffer, to pass as an out-parameter.
    #[inline]
    pub const fn empty() -> AbiBuffer {
        AbiBuffer { ptr: core::ptr::null_mut(), len: 0, cap: 0, free: None }
    }

    /// Hands a vector across: the receiver frees it through `free`, which runs this
    /// library's allocator.
    pub fn from_vec(v: Vec<u8>) -> AbiBuffer {
        let mut v = core::mem::ManuallyDrop::new(v);
        AbiBuffer { ptr: v.as_mut_ptr(), len: v.len(), cap: v.capacity(), free: Some(free_vec) }
    }
}

unsafe extern "C" fn free_vec(ptr: *mut u8, len: usize, cap: usize) {
    if !ptr.is_null() {
        // SAFETY: (ptr, len, cap) came from `AbiBuffer::from_vec` in this same library, and the
        // receiver calls `free` once.
        drop(unsafe { Vec::from_raw_parts(ptr, len, cap) });
    }
}

/// A buffer received from the other side: read it, and it is freed on drop through its own
/// free function.
#[derive(Debug)]
pub struct ReceivedBuffer(AbiBuffer);

impl ReceivedBuffer {
    /// Takes ownership of a buffer the other side filled in.
    ///
    /// # Safety
    /// `buf` must be empty or have been filled by the other side of this ABI and not freed.
    #[inline]
    pub unsafe fn new(buf: AbiBuffer) -> ReceivedBuffer {
        ReceivedBuffer(buf)
    }

    /// The bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        if self.0.ptr.is_null() || self.0.len == 0 {
            &[]
        } else {
            // SAFETY: `new`'s contract: the other side allocated `len` bytes, which live until
            // we call `free` in `drop`.
            unsafe { core::slice::from_raw_parts(self.0.ptr, self.0.len) }
        }
    }
}

impl Drop for ReceivedBuffer {
    #[inline]
    fn drop(&mut self) {
        if let Some(free) = self.0.free {
            // SAFETY: the buffer came from the other side (see `new`) and is freed exactly once,
            // by the function it carries, in the library that allocated it.
            unsafe { free(self.0.ptr, self.0.len, self.0.cap) };
        }
    }
}

// SAFETY: the buffer exclusively owns its bytes; the free function is thread-agnostic
// (it runs the allocating library's global allocator).
unsafe impl Send for ReceivedBuffer {}

/// Log levels on the wire.
pub mod log_level {
    /// Nothing is logged.
    pub const OFF: u32 = 0;
    /// `ERROR`.
    pub const ERROR: u32 = 1;
    /// `WARN`.
    pub const WARN: u32 = 2;
    /// `INFO`.
    pub const INFO: u32 = 3;
    /// `DEBUG`.
    pub const DEBUG: u32 = 4;
    /// `TRACE`.
    pub const TRACE: u32 = 5;
}

/// What the host gives a plugin at load. The host keeps it alive for the life of the
/// process (plugins are never unloaded), so the plugin may keep the pointer.
#[repr(C)]
#[derive(Debug)]
pub struct HostApi {
    /// `size_of::<HostApi>()` as the host was built.
    pub struct_size: usize,
    /// The host's ABI major.
    pub abi_major: u16,
    /// The host's ABI minor.
    pub abi_minor: u16,
    /// The most verbose level the host will show ([`log_level`]); the plugin drops the rest.
    pub max_log_level: u32,
    /// Passed back to `log` unchanged.
    pub user_data: *const c_void,
    /// Receives one log event: level, target (module path), message. Thread-safe.
    pub log: Option<
        unsafe extern "C" fn(user_data: *const c_void, level: u32, target: AbiBytes, message: AbiBytes),
    >,
}

// SAFETY: the host promises `log` may be called from any thread with `user_data`, and the
// struct itself is never written after load.
unsafe impl Sync for HostApi {}
// SAFETY: as above.
unsafe impl Send for HostApi {}

impl HostApi {
    /// Sends one log event to the host.
    pub fn log(&self, level: u32, target: &str, message: &str) {
        if let Some(log) = self.log {
            // SAFETY: the host gave us `log` and `user_data` for this purpose; both byte views
            // are valid for the call.
            unsafe {
                log(
                    self.user_data,
                    level,
                    AbiBytes::from_slice(target.as_bytes()),
                    AbiBytes::from_slice(message.as_bytes()),
                )
            }
        }
    }
}

/// `init(host, err)`: called once, right after the host has checked the descriptor.
pub type InitFn = unsafe extern "C" fn(host: *const HostApi, err: *mut AbiBuffer) -> Status;
/// `factory_new(out, err)`: creates the plugin's factory; `*out` is its handle.
pub type FactoryNewFn = unsafe extern "C" fn(out: *mut *mut c_void, err: *mut AbiBuffer) -> Status;

/// A factory query: `config` = JSON `KvTransferConfig`, `model` = JSON `ModelSpec` or empty
/// for none; `*out` = the answer, JSON.
pub type FactoryQueryFn = unsafe extern "C" fn(
    this: *mut c_void,
    config: AbiBytes,
    model: AbiBytes,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status;

/// What `kvconnect_plugin_entry` returns. The fields up to `rustc_version` are the fixed
/// header: they never move, in any ABI version, so a host can name any plugin it refuses.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PluginDescriptor {
    /// [`ABI_MAGIC`].
    pub magic: u64,
    /// [`ABI_MAJOR`] the plugin was built with.
    pub abi_major: u16,
    /// [`ABI_MINOR`] the plugin was built with.
    pub abi_minor: u16,
    /// `size_of::<PluginDescriptor>()` as the plugin was built.
    pub struct_size: usize,
    /// [`LAYOUT_FINGERPRINT`] as the plugin was built.
    pub layout_fingerprint: u64,
    /// The connector name the plugin registers (`example`, `nixl`, ...).
    pub name: AbiBytes,
    /// The plugin's version.
    pub version: AbiBytes,
    /// [`SDK_VERSION`] the plugin was built with.
    pub sdk_version: AbiBytes,
    /// [`RUSTC_VERSION`] the plugin was built with.
    pub rustc_version: AbiBytes,
    /// Called once after the checks, with the host's callbacks.
    pub init: Option<InitFn>,
    /// Creates the factory.
    pub factory_new: Option<FactoryNewFn>,
    /// The factory's vtable.
    pub factory: *const FactoryVTable,
    /// The scheduler half's vtable.
    pub scheduler: *const SchedulerVTable,
    /// The worker half's vtable.
    pub worker: *const WorkerVTable,
}

// SAFETY: a descriptor only points at 'static, immutable data (strings and vtables in the
// plugin's read-only memory).
unsafe impl Sync for PluginDescriptor {}
// SAFETY: as above.
unsafe impl Send for PluginDescriptor {}

// ---------------------------------------------------------------------------------------
// Layout fingerprint and minimum sizes.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

const fn mix_str(mut h: u64, s: &str) -> u64 {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    h
}

const fn mix(mut h: u64, x: usize) -> u64 {
    let bytes = (x as u64).to_le_bytes();
    let mut i = 0;
    while i < 8 {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    h
}

/// Folds a struct's alignment, the offset of each listed field and the end of the last one
/// into the hash. Only the fields ABI `.0` defined are listed, and the struct's total size is
/// deliberately left out: entries appended in a later minor change neither.
macro_rules! fold_struct {
    ($h:ident, $t:ty, $end:expr; $($f:ident),* $(,)?) => {{
        let mut h = mix($h, core::mem::align_of::<$t>());
        $( h = mix(h, offset_of!($t, $f)); )*
        mix(h, $end)
    }};
}

/// A hash of the layout of every ABI struct as this major's `.0` defined it: alignment, the
/// offsets of the header and of the `.0` entries, and where the `.0` entries end. It does not
/// cover the struct sizes, so entries appended in a later minor leave it unchanged: every 1.x
/// plugin reports the same value on the same target, and a vtable's own `struct_size` says
/// which entries it has. A different value means the plugin's idea of the structs differs
/// from the host's (another target, a patched SDK).
pub const LAYOUT_FINGERPRINT: u64 = {
    let h = mix(FNV_OFFSET, ABI_MAJOR as usize);
    let h = fold_struct!(h, AbiBytes, size_of::<AbiBytes>(); ptr, len);
    let h = fold_struct!(h, AbiBuffer, size_of::<AbiBuffer>(); ptr, len, cap, free);
    let h = fold_struct!(h, HostApi, MIN_HOST_API_SIZE; struct_size, abi_major, abi_minor, max_log_level,
        user_data, log);
    let h = fold_struct!(h, PluginDescriptor, MIN_DESCRIPTOR_SIZE; magic, abi_major, abi_minor, struct_size,
        layout_fingerprint, name, version, sdk_version, rustc_version, init, factory_new, factory, scheduler,
        worker);
    let h = FactoryVTable::fold_layout(h);
    let h = SchedulerVTable::fold_layout(h);
    WorkerVTable::fold_layout(h)
};

/// Bytes of the descriptor a host of this version reads (everything 1.0 defined).
pub const MIN_DESCRIPTOR_SIZE: usize =
    offset_of!(PluginDescriptor, worker) + size_of::<*const WorkerVTable>();
/// Bytes of the factory vtable a host of this major calls (its `.0` entries).
pub const MIN_FACTORY_VTABLE_SIZE: usize = FactoryVTable::MIN_SIZE;
/// Bytes of the scheduler vtable a host of this major calls.
pub const MIN_SCHEDULER_VTABLE_SIZE: usize = SchedulerVTable::MIN_SIZE;
/// Bytes of the worker vtable a host of this major calls.
pub const MIN_WORKER_VTABLE_SIZE: usize = WorkerVTable::MIN_SIZE;
/// Bytes of the host API a plugin of this version reads.
pub const MIN_HOST_API_SIZE: usize = offset_of!(HostApi, log) + size_of::<usize>();

/// A versioned ABI struct: it starts with (or, for the descriptor, holds at a fixed offset)
/// its own `struct_size`, and all-zero bytes are a valid value of it, in which every entry is
/// absent (`None`, null).
///
/// # Safety
/// Implement it only for `repr(C)` structs whose fields are integers, raw pointers, `AbiBytes`
/// and `Option`s of function pointers, for which zero is a valid value.
pub unsafe trait Versioned: Copy {}
// SAFETY: integers, raw pointers, `AbiBytes` and `Option<fn>` only.
unsafe impl Versioned for PluginDescriptor {}

/// Reads a versioned struct the other side declared `declared` bytes long, as this side
/// defines it: the bytes the two have in common are copied, and the entries this side knows
/// but the other side's (older) minor does not are absent. Entries the other side's (newer)
/// minor appended are not read at all. This is how a host of any 1.x reads the descriptor and
/// vtables of a plugin of any 1.x.
///
/// # Safety
/// `src` must point to at least `declared` readable bytes.
pub unsafe fn read_declared<T: Versioned>(src: *const T, declared: usize) -> T {
    let mut v = core::mem::MaybeUninit::<T>::zeroed();
    // Whole fields only: every entry is pointer-sized and pointer-aligned, so rounding down to
    // the alignment never keeps half of one.
    let n = declared.min(size_of::<T>()) & !(core::mem::align_of::<T>() - 1);
    // SAFETY: `src` has `declared >= n` readable bytes (the caller's contract), the
    // destination `size_of::<T>() >= n`; the two do not overlap (one is on our stack). Zero
    // is valid for the bytes not copied (`Versioned`), and the copied prefix holds the other
    // side's values of the same fields, so the result is a valid `T`.
    unsafe {
        core::ptr::copy_nonoverlapping(src as *const u8, v.as_mut_ptr() as *mut u8, n);
        v.assume_init()
    }
}

// ---------------------------------------------------------------------------------------
// The plugin side: descriptor construction and the shims behind every vtable entry.

/// Makes the plugin's factory; `export_connector!` implements it for a hidden type.
pub trait MakeFactory {
    /// The connector name the plugin registers.
    const NAME: &'static str;
    /// The plugin's version.
    const VERSION: &'static str;
    /// Builds the factory (runs inside `catch_unwind`).
    fn make() -> Box<dyn crate::connector::ConnectorFactory>;
}

impl PluginDescriptor {
    /// The descriptor for the factory `M` makes, with this SDK's vtables.
    pub const fn new<M: MakeFactory>() -> PluginDescriptor {
        PluginDescriptor {
            magic: ABI_MAGIC,
            abi_major: ABI_MAJOR,
            abi_minor: ABI_MINOR,
            struct_size: size_of::<PluginDescriptor>(),
            layout_fingerprint: LAYOUT_FINGERPRINT,
            name: AbiBytes::from_static(M::NAME),
            version: AbiBytes::from_static(M::VERSION),
            sdk_version: AbiBytes::from_static(SDK_VERSION),
            rustc_version: AbiBytes::from_static(RUSTC_VERSION),
            init: Some(plugin_init),
            factory_new: Some(factory_new::<M>),
            factory: &FactoryVTable::EXPORTED,
            scheduler: &SchedulerVTable::EXPORTED,
            worker: &WorkerVTable::EXPORTED,
        }
    }
}

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

/// Writes `r` to the out-parameters: the value through `write_ok`, an error as JSON.
#[inline]
fn finish<T>(r: Result<T, ConnectorError>, err: *mut AbiBuffer, write_ok: impl FnOnce(T)) -> Status {
    match r {
        Ok(v) => {
            write_ok(v);
            status::OK
        }
        Err(e) => {
            let code = status_of(&e);
            if !err.is_null() {
                let bytes = serde_json::to_vec(&e).unwrap_or_else(|_| e.to_string().into_bytes());
                // SAFETY: the host passes a valid, writable out-parameter (or null, checked).
                unsafe { err.write(AbiBuffer::from_vec(bytes)) };
            }
            code
        }
    }
}

/// Writes a JSON-encoded value to `out`.
fn write_json<T: serde::Serialize>(
    connector: &str,
    v: &T,
    out: *mut AbiBuffer,
) -> Result<(), ConnectorError> {
    let bytes = serde_json::to_vec(v).map_err(|e| ConnectorError::Other {
        connector: connector.to_owned(),
        message: format!("cannot encode a result: {e}"),
    })?;
    write_buf(out, bytes);
    Ok(())
}

fn write_buf(out: *mut AbiBuffer, bytes: Vec<u8>) {
    if !out.is_null() {
        // SAFETY: the host passes a valid, writable out-parameter (or null, checked).
        unsafe { out.write(AbiBuffer::from_vec(bytes)) };
    }
}

fn read_json<T: serde::de::DeserializeOwned>(
    connector: &str,
    what: &str,
    b: AbiBytes,
) -> Result<T, ConnectorError> {
    // SAFETY: the host passes bytes valid for the duration of this call.
    let bytes = unsafe { b.as_slice() };
    serde_json::from_slice(bytes).map_err(|e| ConnectorError::InvalidArgument {
        connector: connector.to_owned(),
        message: format!("the host sent a {what} that does not decode: {e}"),
    })
}

/// # Safety
/// `this` must be a live handle of type `T` from this library, used by one thread at a time.
unsafe fn handle<'a, T>(this: *mut c_void) -> &'a mut T {
    // SAFETY: the caller's contract.
    unsafe { &mut *(this as *mut T) }
}

unsafe extern "C" fn plugin_init(host: *const HostApi, err: *mut AbiBuffer) -> Status {
    let r = if host.is_null() {
        Err(ConnectorError::Other {
            connector: "plugin".into(),
            message: "the host passed no host API".into(),
        })
    } else {
        // SAFETY: the host keeps its HostApi alive for the life of the process (documented
        // on `HostApi`), so a 'static borrow is sound.
        let api: &'static HostApi = unsafe { &*host };
        sdk::init(api)
    };
    finish(r, err, |()| ())
}

unsafe extern "C" fn factory_new<M: MakeFactory>(out: *mut *mut c_void, err: *mut AbiBuffer) -> Status {
    let r = ExportedFactory::new(M::NAME, M::make);
    finish(r, err, |f| {
        if !out.is_null() {
            // SAFETY: valid out-parameter from the host.
            unsafe { out.write(Box::into_raw(Box::new(f)) as *mut c_void) };
        }
    })
}

unsafe extern "C" fn factory_free(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: `this` came from `factory_new` (Box::into_raw) and the host frees it once.
        drop(unsafe { Box::from_raw(this as *mut ExportedFactory) });
    }
}

unsafe extern "C" fn factory_info(this: *mut c_void, out: *mut AbiBuffer, err: *mut AbiBuffer) -> Status {
    // SAFETY: a live factory handle; factories are Sync, so a shared borrow is enough.
    let f = unsafe { &*(this as *const ExportedFactory) };
    finish(f.call("info", |c| Ok(c.info())).and_then(|i| write_json(f.name(), &i, out)), err, |()| ())
}

/// A factory query that takes a config and a model and answers JSON: one shim,
/// [`factory_query`], serves each.
trait FactoryQuery {
    const METHOD: &'static str;
    type Answer: serde::Serialize;
    fn ask(
        c: &dyn crate::connector::ConnectorFactory,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> Result<Self::Answer, ConnectorError>;
}

/// `FactoryVTable::capabilities`.
struct CapabilitiesQuery;
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
struct ChildCapabilitiesQuery;
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
unsafe extern "C" fn factory_query<Q: FactoryQuery>(
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

unsafe extern "C" fn factory_create_scheduler(
    this: *mut c_void,
    ctx: AbiBytes,
    out: *mut *mut c_void,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live factory handle; factories are Sync.
    let f = unsafe { &*(this as *const ExportedFactory) };
    let r = read_json::<ConnectorContext>(f.name(), "connector context", ctx)
        .and_then(|ctx| f.create_scheduler(&ctx));
    finish(r, err, |s| {
        if !out.is_null() {
            // SAFETY: valid out-parameter from the host.
            unsafe { out.write(Box::into_raw(Box::new(s)) as *mut c_void) };
        }
    })
}

unsafe extern "C" fn factory_create_worker(
    this: *mut c_void,
    ctx: AbiBytes,
    out: *mut *mut c_void,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live factory handle; factories are Sync.
    let f = unsafe { &*(this as *const ExportedFactory) };
    let r = read_json::<ConnectorContext>(f.name(), "connector context", ctx)
        .and_then(|ctx| f.create_worker(&ctx));
    finish(r, err, |w| {
        if !out.is_null() {
            // SAFETY: valid out-parameter from the host.
            unsafe { out.write(Box::into_raw(Box::new(w)) as *mut c_void) };
        }
    })
}

unsafe extern "C" fn scheduler_free(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: `this` came from `create_scheduler` (Box::into_raw) and is freed once.
        drop(unsafe { Box::from_raw(this as *mut ExportedScheduler) });
    }
}

unsafe extern "C" fn scheduler_get_num_new_matched_tokens(
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

unsafe extern "C" fn scheduler_update_state_after_alloc(
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

unsafe extern "C" fn scheduler_build_connector_meta(
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

unsafe extern "C" fn scheduler_request_finished(
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

unsafe extern "C" fn scheduler_take_events(
    this: *mut c_void,
    out: *mut AbiBuffer,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live scheduler handle, one thread at a time.
    let s = unsafe { handle::<ExportedScheduler>(this) };
    let r = s.call("take_events", |c| c.take_events()).and_then(|ev| write_json(s.name(), &ev, out));
    finish(r, err, |()| ())
}

unsafe extern "C" fn worker_free(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: `this` came from `create_worker` (Box::into_raw) and is freed once.
        drop(unsafe { Box::from_raw(this as *mut ExportedWorker) });
    }
}

unsafe extern "C" fn worker_register_kv_caches(
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

unsafe extern "C" fn worker_bind_connector_meta(
    this: *mut c_void,
    meta: AbiBytes,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time; `meta` is valid for the call.
    let (w, meta) = unsafe { (handle::<ExportedWorker>(this), meta.as_slice()) };
    finish(w.call("bind_connector_meta", |c| c.bind_connector_meta(meta)), err, |()| ())
}

unsafe extern "C" fn worker_start_load_kv(this: *mut c_void, err: *mut AbiBuffer) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("start_load_kv", |c| c.start_load_kv()), err, |()| ())
}

unsafe extern "C" fn worker_wait_for_layer_load(
    this: *mut c_void,
    layer: u32,
    err: *mut AbiBuffer,
) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("wait_for_layer_load", |c| c.wait_for_layer_load(LayerId(layer))), err, |()| ())
}

unsafe extern "C" fn worker_save_kv_layer(
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

unsafe extern "C" fn worker_wait_for_save(this: *mut c_void, err: *mut AbiBuffer) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("wait_for_save", |c| c.wait_for_save()), err, |()| ())
}

unsafe extern "C" fn worker_get_finished(
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

unsafe extern "C" fn worker_block_ids_with_load_errors(
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

unsafe extern "C" fn worker_handshake_metadata(
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

unsafe extern "C" fn worker_set_peer_handshake_metadata(
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

unsafe extern "C" fn worker_shutdown(this: *mut c_void, err: *mut AbiBuffer) -> Status {
    // SAFETY: a live worker handle, one thread at a time.
    let w = unsafe { handle::<ExportedWorker>(this) };
    finish(w.call("shutdown", |c| c.shutdown()), err, |()| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fields_never_move() {
        assert_eq!(offset_of!(PluginDescriptor, magic), 0);
        assert_eq!(offset_of!(PluginDescriptor, abi_major), 8);
        assert_eq!(offset_of!(PluginDescriptor, abi_minor), 10);
        assert_eq!(offset_of!(PluginDescriptor, struct_size), 16);
        assert_eq!(offset_of!(PluginDescriptor, layout_fingerprint), 16 + size_of::<usize>());
    }

    #[test]
    fn minimum_sizes_cover_the_1_0_entries() {
        assert_eq!(MIN_DESCRIPTOR_SIZE, size_of::<PluginDescriptor>());
        // 1.1 appended `child_capabilities`, which a host may find absent.
        #[cfg(not(feature = "abi_1_0"))]
        assert_eq!(MIN_FACTORY_VTABLE_SIZE, offset_of!(FactoryVTable, child_capabilities));
        #[cfg(feature = "abi_1_0")]
        assert_eq!(MIN_FACTORY_VTABLE_SIZE, size_of::<FactoryVTable>());
        assert_eq!(MIN_SCHEDULER_VTABLE_SIZE, size_of::<SchedulerVTable>());
        assert_eq!(MIN_WORKER_VTABLE_SIZE, size_of::<WorkerVTable>());
        assert_eq!(MIN_HOST_API_SIZE, size_of::<HostApi>());
    }

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct V10 {
        struct_size: usize,
        a: Option<extern "C" fn() -> Status>,
    }

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct V11 {
        struct_size: usize,
        a: Option<extern "C" fn() -> Status>,
        b: Option<extern "C" fn() -> Status>,
    }

    // SAFETY: a usize and `Option<fn>`s.
    unsafe impl Versioned for V10 {}
    // SAFETY: as above.
    unsafe impl Versioned for V11 {}

    extern "C" fn seven() -> Status {
        7
    }

    #[test]
    fn an_appended_entry_leaves_the_fingerprint_alone() {
        let end = offset_of!(V10, a) + size_of::<usize>();
        let h10 = fold_struct!(FNV_OFFSET, V10, end; struct_size, a);
        let h11 = fold_struct!(FNV_OFFSET, V11, end; struct_size, a);
        assert_eq!(h10, h11);
        // Moving a 1.0 entry does change it.
        let moved = fold_struct!(FNV_OFFSET, V11, end; struct_size, b);
        assert_ne!(h10, moved);
    }

    #[test]
    fn each_side_reads_the_entries_both_know() {
        // A newer vtable read by an older side: the appended entry is not read.
        let new = V11 { struct_size: size_of::<V11>(), a: Some(seven), b: Some(seven) };
        // SAFETY: `new` is `struct_size` bytes long.
        let old: V10 = unsafe { read_declared(&new as *const V11 as *const V10, new.struct_size) };
        assert_eq!(old.a.map(|f| f()), Some(7));
        // An older vtable read by a newer side: the entry it lacks is absent.
        let old = V10 { struct_size: size_of::<V10>(), a: Some(seven) };
        // SAFETY: `old` is `struct_size` bytes long; nothing past it is read.
        let new: V11 = unsafe { read_declared(&old as *const V10 as *const V11, old.struct_size) };
        assert_eq!(new.a.map(|f| f()), Some(7));
        assert!(new.b.is_none());
        // A size that cuts an entry in half drops the whole entry.
        // SAFETY: as above, fewer bytes.
        let cut: V11 = unsafe { read_declared(&old as *const V10 as *const V11, old.struct_size - 3) };
        assert!(cut.a.is_none());
    }

    #[test]
    fn magic_spells_kvconnec() {
        assert_eq!(&ABI_MAGIC.to_le_bytes(), b"KVCONNEC");
    }

    #[test]
    fn errors_round_trip_through_buffers() {
        let mut err = AbiBuffer::empty();
        let e = ConnectorError::invalid("x", "bad block");
        let code = finish::<()>(Err(e.clone()), &mut err, |()| ());
        assert_eq!(code, status::INVALID_ARGUMENT);
        // SAFETY: filled by `finish` just above.
        let buf = unsafe { ReceivedBuffer::new(err) };
        let back: ConnectorError = serde_json::from_slice(buf.as_bytes()).unwrap();
        assert_eq!(back, e);
    }
}

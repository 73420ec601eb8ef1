//! The descriptor a plugin exports: its fixed header, the layout fingerprint, the minimum
//! sizes a host of this major needs, and how each side reads a struct the other may have
//! declared shorter or longer.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::*;
use core::ffi::c_void;
use core::mem::{offset_of, size_of};

/// `init(host, err)`: called once, right after the host has checked the descriptor.
pub type InitFn = unsafe extern "C" fn(host: *const HostApi, err: *mut AbiBuffer) -> Status;
/// `factory_new(out, err)`: creates the plugin's factory; `*out` is its handle.
pub type FactoryNewFn = unsafe extern "C" fn(out: *mut *mut c_void, err: *mut AbiBuffer) -> Status;

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

pub(super) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

pub(super) const fn mix_str(mut h: u64, s: &str) -> u64 {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    h
}

pub(super) const fn mix(mut h: u64, x: usize) -> u64 {
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
            init: Some(log::plugin_init),
            factory_new: Some(factory::factory_new::<M>),
            factory: &FactoryVTable::EXPORTED,
            scheduler: &SchedulerVTable::EXPORTED,
            worker: &WorkerVTable::EXPORTED,
        }
    }
}

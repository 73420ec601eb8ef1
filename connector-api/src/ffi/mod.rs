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
//!   (`panic_guard`), turns it into [`status::PANICKED`] and poisons the instance.
//!
//! `include/kvconnect.h` is the same ABI for C and C++, written from these definitions by
//! [`c_header`]; a test keeps the checked-in file equal to it and checks its sizes and offsets.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use crate::error::ConnectorError;

mod buffers;
mod call;
#[macro_use]
mod descriptor;
#[macro_use]
mod vtables;
mod factory;
mod header;
mod json_values;
mod log;
mod marshal;
mod panic_guard;
mod scheduler;
mod shim;
mod worker;
pub use buffers::*;
pub use call::{call_status, PluginCode, PluginEntries};
pub use descriptor::*;
pub use factory::{FactoryFns, FactoryVTable, ForeignFactory};
pub use header::c_header;
#[cfg(feature = "schema")]
pub use json_values::json_schemas;
pub use json_values::{json_values, JsonValue, SCHEMA_DIR};
pub use log::*;
pub use scheduler::{ForeignScheduler, SchedulerFns, SchedulerVTable};
pub use vtables::{CType, EntryInfo};
pub use worker::{ForeignWorker, WorkerFns, WorkerVTable};

/// `kvconnect_plugin_entry`: the one symbol a plugin exports.
pub const ENTRY_SYMBOL: &str = "kvconnect_plugin_entry";
/// The first field of every descriptor: "KVCONNEC" read as a little-endian u64.
pub const ABI_MAGIC: u64 = u64::from_le_bytes(*b"KVCONNEC");
/// Breaking changes bump the major; a host refuses a plugin of another major.
pub const ABI_MAJOR: u16 = 1;
/// Additions (entries appended to a vtable) bump the minor; a host accepts a newer minor.
/// 1.1 appended `FactoryVTable::child_capabilities`; 1.2 `SchedulerVTable::take_kv_events`;
/// 1.3 `SchedulerVTable::metrics` and `WorkerVTable::metrics`.
#[cfg(not(feature = "abi_1_0"))]
pub const ABI_MINOR: u16 = 3;
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

#[cfg(test)]
mod tests {
    use super::descriptor::{mix, FNV_OFFSET};
    use super::shim::finish;
    use super::*;
    use core::mem::{offset_of, size_of};

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
        // 1.2 appended `take_kv_events`.
        #[cfg(not(feature = "abi_1_0"))]
        assert_eq!(MIN_SCHEDULER_VTABLE_SIZE, offset_of!(SchedulerVTable, take_kv_events));
        #[cfg(feature = "abi_1_0")]
        assert_eq!(MIN_SCHEDULER_VTABLE_SIZE, size_of::<SchedulerVTable>());
        // 1.3 appended the worker's `metrics`.
        #[cfg(not(feature = "abi_1_0"))]
        assert_eq!(MIN_WORKER_VTABLE_SIZE, offset_of!(WorkerVTable, metrics));
        #[cfg(feature = "abi_1_0")]
        assert_eq!(MIN_WORKER_VTABLE_SIZE, size_of::<WorkerVTable>());
        assert_eq!(MIN_HOST_API_SIZE, size_of::<HostApi>());
    }

    #[test]
    fn minimum_sizes_per_minor_end_at_that_minors_last_entry() {
        // 1.3's `metrics` is the worker's last entry: a plugin before 1.3 exports the vtable
        // up to it, a 1.3 plugin (or a newer one) the whole struct this host knows.
        #[cfg(not(feature = "abi_1_0"))]
        for minor in 0..=ABI_MINOR + 1 {
            let want = if minor >= 3 { size_of::<WorkerVTable>() } else { MIN_WORKER_VTABLE_SIZE };
            assert_eq!(WorkerVTable::min_size_for_minor(minor), want, "minor {minor}");
        }
        // 1.2 appended the scheduler's `take_kv_events`, 1.3 its `metrics`, the last entry.
        #[cfg(not(feature = "abi_1_0"))]
        for minor in 0..=ABI_MINOR + 1 {
            let want = match minor {
                0 | 1 => MIN_SCHEDULER_VTABLE_SIZE,
                2 => offset_of!(SchedulerVTable, metrics),
                _ => size_of::<SchedulerVTable>(),
            };
            assert_eq!(SchedulerVTable::min_size_for_minor(minor), want, "minor {minor}");
        }
        assert_eq!(FactoryVTable::min_size_for_minor(0), MIN_FACTORY_VTABLE_SIZE);
        // 1.1's `child_capabilities` is the factory's last entry: a 1.1 plugin (or a newer one)
        // exports the whole struct this host knows.
        #[cfg(not(feature = "abi_1_0"))]
        for minor in 1..=ABI_MINOR + 1 {
            assert_eq!(FactoryVTable::min_size_for_minor(minor), size_of::<FactoryVTable>());
        }
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

    /// A plugin's `get_finished` answer, written by its shim and read by the host's, arrives
    /// with its `load_sources` whole; an answer from a plugin built before them (no such
    /// field) still decodes, with none.
    #[test]
    fn load_sources_cross_the_abi_and_older_answers_still_decode() {
        use super::call::call_json;
        use super::shim::{write_buf, write_json};
        use crate::{FinishedTransfers, RequestId};
        let r1 = RequestId::from("r1");
        let mut sent = FinishedTransfers { finished_recving: vec![r1.clone()], ..Default::default() };
        sent.add_load(&r1, "my-plugin", "disk", 16);
        sent.add_load(&r1, "my-plugin", "disk", 16);
        sent.add_load(&r1, "my-plugin", "cpu", 0);
        sent.add_load(&RequestId::from("r2"), "my-plugin", "disk", 8);
        let got: FinishedTransfers = call_json(
            || "my-plugin",
            "get_finished",
            |out, _err| {
                write_json("my-plugin", &sent, out).unwrap();
                status::OK
            },
        )
        .unwrap();
        assert_eq!(got, sent);
        assert_eq!(
            serde_json::to_value(&got.load_sources).unwrap(),
            serde_json::json!([
                {"request": "r1", "connector": "my-plugin", "tier": "disk", "tokens": 32},
                {"request": "r2", "connector": "my-plugin", "tier": "disk", "tokens": 8},
            ])
        );

        let old = br#"{"finished_sending":["s1"],"finished_recving":[],"failed_recving":[]}"#;
        let got: FinishedTransfers = call_json(
            || "old-plugin",
            "get_finished",
            |out, _err| {
                write_buf(out, old.to_vec());
                status::OK
            },
        )
        .unwrap();
        assert_eq!(
            got,
            FinishedTransfers { finished_sending: vec![RequestId::from("s1")], ..Default::default() }
        );
        // And an answer without sources is written as before.
        assert_eq!(serde_json::to_vec(&got).unwrap(), old.to_vec());
    }
}

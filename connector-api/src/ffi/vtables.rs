//! The three vtables, each entry listed once in [`vtable!`]. From that one list come the
//! `#[repr(C)]` struct, the minimum size a host of this major needs, the entries' part of the
//! layout fingerprint, the host's checked copy (`*Fns`: 1.0 entries required, later ones
//! optional, each with its fallback), and the C header's declarations (`header.rs`).
//! Adding an entry in a new minor is one line in an `optional` block here.

use super::{mix, mix_str, AbiBuffer, AbiBytes, Status, Versioned};
use core::ffi::c_void;
use core::mem::{offset_of, size_of};

/// The C spelling of a type that crosses the boundary.
pub trait CType {
    /// As `kvconnect.h` writes it.
    const C: &'static str;
}

macro_rules! c_types {
    ($($t:ty => $c:literal),* $(,)?) => { $(impl CType for $t { const C: &'static str = $c; })* };
}

c_types! {
    *mut c_void => "void *",
    *mut *mut c_void => "void **",
    AbiBytes => "kvc_bytes",
    *const AbiBytes => "const kvc_bytes *",
    *mut AbiBuffer => "kvc_buffer *",
    u32 => "uint32_t",
    u64 => "uint64_t",
    usize => "size_t",
    *const u32 => "const uint32_t *",
    // `Status` is the only i32 that crosses.
    i32 => "kvc_status",
}

/// One vtable entry, for the C header and the layout checks.
#[derive(Debug, Clone, Copy)]
pub struct EntryInfo {
    /// The field name.
    pub name: &'static str,
    /// Its byte offset.
    pub offset: usize,
    /// The minor that added it (0: the major's `.0`, which requires it).
    pub since_minor: u16,
    /// What the host does when the entry is absent (only for entries added after `.0`).
    pub fallback: Option<&'static str>,
    /// Its documentation.
    pub doc: &'static [&'static str],
    /// The C return type.
    pub c_ret: &'static str,
    /// The C parameters: type and name.
    pub c_params: &'static [(&'static str, &'static str)],
}

macro_rules! c_ret {
    () => {
        "void"
    };
    ($t:ty) => {
        <$t as CType>::C
    };
}

macro_rules! vtable {
    (
        $(#[doc = $sdoc:literal])*
        $name:ident, checked $checked:ident, c $cname:literal {
            $(
                $(#[doc = $doc:literal])*
                $entry:ident ( $($arg:ident : $aty:ty),* $(,)? ) $(-> $ret:ty)?;
            )*
        }
        optional {
            $(
                $(#[doc = $odoc:literal])*
                #[since(1, $minor:literal)] $(#[cfg($cfg:meta)])?
                $oentry:ident ( $($oarg:ident : $oaty:ty),* $(,)? ) $(-> $oret:ty)?, else $fallback:literal;
            )*
        }
    ) => {
        $(#[doc = $sdoc])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy)]
        pub struct $name {
            /// `size_of` this struct as the plugin was built: which entries it has.
            pub struct_size: usize,
            $(
                $(#[doc = $doc])*
                pub $entry: Option<unsafe extern "C" fn($($arg: $aty),*) $(-> $ret)?>,
            )*
            $(
                $(#[doc = $odoc])*
                #[doc = concat!("\n\nSince 1.", $minor, "; may be null (or absent, in an older plugin): ", $fallback)]
                $(#[cfg($cfg)])?
                pub $oentry: Option<unsafe extern "C" fn($($oarg: $oaty),*) $(-> $oret)?>,
            )*
        }

        // SAFETY: a usize and `Option`s of function pointers, all valid as zero.
        unsafe impl Versioned for $name {}

        impl $name {
            /// The C name of the struct.
            pub const C_NAME: &'static str = $cname;

            /// Bytes of it a host of this major calls: up to the last `.0` entry.
            pub const MIN_SIZE: usize = {
                let mut end = size_of::<usize>();
                $(
                    let e = offset_of!($name, $entry) + size_of::<usize>();
                    if e > end {
                        end = e;
                    }
                )*
                end
            };

            /// Folds the `.0` layout into the fingerprint: alignment, each entry's offset and
            /// parameter types, where they end. Not the struct's size, which later minors grow.
            pub(crate) const fn fold_layout(h: u64) -> u64 {
                let mut h = mix(h, core::mem::align_of::<$name>());
                h = mix(h, offset_of!($name, struct_size));
                $(
                    h = mix(h, offset_of!($name, $entry));
                    h = mix_str(h, stringify!(($($aty),*) $(-> $ret)?));
                )*
                mix(h, Self::MIN_SIZE)
            }

            /// Every entry, in order.
            pub fn entries() -> Vec<EntryInfo> {
                #[allow(unused_mut)]
                let mut v = vec![$(EntryInfo {
                    name: stringify!($entry),
                    offset: offset_of!($name, $entry),
                    since_minor: 0,
                    fallback: None,
                    doc: &[$($doc),*],
                    c_ret: c_ret!($($ret)?),
                    c_params: &[$((<$aty as CType>::C, stringify!($arg))),*],
                }),*];
                $(
                    $(#[cfg($cfg)])?
                    v.push(EntryInfo {
                        name: stringify!($oentry),
                        offset: offset_of!($name, $oentry),
                        since_minor: $minor,
                        fallback: Some($fallback),
                        doc: &[$($odoc),*],
                        c_ret: c_ret!($($oret)?),
                        c_params: &[$((<$oaty as CType>::C, stringify!($oarg))),*],
                    });
                )*
                v
            }
        }

        #[doc = concat!("A checked copy of a plugin's `", stringify!($name), "`: every `.0` entry present, later ones optional.")]
        #[derive(Debug, Clone, Copy)]
        pub struct $checked {
            $(
                #[doc = concat!("`", stringify!($name), "::", stringify!($entry), "`.")]
                pub $entry: unsafe extern "C" fn($($arg: $aty),*) $(-> $ret)?,
            )*
            $(
                #[doc = concat!("`", stringify!($name), "::", stringify!($oentry), "`; absent: ", $fallback)]
                $(#[cfg($cfg)])?
                pub $oentry: Option<unsafe extern "C" fn($($oarg: $oaty),*) $(-> $oret)?>,
            )*
        }

        impl $checked {
            /// Checks that every `.0` entry is there; names the first one missing.
            pub fn check(vt: &$name) -> Result<$checked, &'static str> {
                Ok($checked {
                    $( $entry: vt.$entry.ok_or(stringify!($entry))?, )*
                    $( $(#[cfg($cfg)])? $oentry: vt.$oentry, )*
                })
            }
        }
    };
}

type This = *mut c_void;
type Out = *mut AbiBuffer;
type Err = *mut AbiBuffer;

vtable! {
    /// The factory's entry points. `this` is the handle `factory_new` returned; a factory may
    /// be called from any thread.
    FactoryVTable, checked FactoryFns, c "kvc_factory_vtable" {
        /// Frees the factory.
        free(this: This);
        /// `*out` = JSON `ConnectorInfo`.
        info(this: This, out: Out, err: Err) -> Status;
        /// `config` = JSON `KvTransferConfig`, `model` = JSON `ModelSpec` or empty; `*out` = JSON
        /// `Capabilities`.
        capabilities(this: This, config: AbiBytes, model: AbiBytes, out: Out, err: Err) -> Status;
        /// `ctx` = JSON `ConnectorContext`; `*out` = the scheduler handle.
        create_scheduler(this: This, ctx: AbiBytes, out: *mut *mut c_void, err: Err) -> Status;
        /// `ctx` = JSON `ConnectorContext`; `*out` = the worker handle.
        create_worker(this: This, ctx: AbiBytes, out: *mut *mut c_void, err: Err) -> Status;
    }
    optional {
        /// For a composite: `config`, `model` as for `capabilities`; `*out` = JSON
        /// `Option<Vec<ChildCaps>>` (a list of {name, version, caps}), `null` for a plain connector.
        #[since(1, 1)] #[cfg(not(feature = "abi_1_0"))]
        child_capabilities(this: This, config: AbiBytes, model: AbiBytes, out: Out, err: Err) -> Status,
            else "the connector has no children";
    }
}

vtable! {
    /// Scheduler-half entry points; `this` is a scheduler handle, used from one thread at a
    /// time.
    SchedulerVTable, checked SchedulerFns, c "kvc_scheduler_vtable" {
        /// Frees the instance.
        free(this: This);
        /// `req` = JSON `Request`; `*out` = JSON `MatchResult`.
        get_num_new_matched_tokens(this: This, req: AbiBytes, num_computed: u64, out: Out, err: Err) -> Status;
        /// `req` = JSON `Request`, `blocks` = JSON `BlocksPerGroup`.
        update_state_after_alloc(this: This, req: AbiBytes, blocks: AbiBytes, num_external_tokens: u64, err: Err)
            -> Status;
        /// `step` = JSON `StepInfo`; `*out` = the metadata bytes, as the connector made them.
        build_connector_meta(this: This, step: AbiBytes, out: Out, err: Err) -> Status;
        /// `req`, `blocks` as above; `*out` = JSON `RequestFinished`.
        request_finished(this: This, req: AbiBytes, blocks: AbiBytes, out: Out, err: Err) -> Status;
        /// `*out` = JSON `Vec<KvEvent>`.
        take_events(this: This, out: Out, err: Err) -> Status;
    }
    optional {}
}

vtable! {
    /// Worker-half entry points; `this` is a worker handle, used from one thread at a time.
    WorkerVTable, checked WorkerFns, c "kvc_worker_vtable" {
        /// Frees the instance.
        free(this: This);
        /// `regions` = JSON `Vec<KvRegionSpec>` (a list of {name, addr, len, memory, device,
        /// layers, group, num_blocks, shm_name?}): regions the host vouches for as
        /// `KvRegion::new` requires; it keeps that memory valid until it frees this instance.
        register_kv_caches(this: This, regions: AbiBytes, err: Err) -> Status;
        /// The scheduler's metadata bytes for this step.
        bind_connector_meta(this: This, meta: AbiBytes, err: Err) -> Status;
        /// Starts this step's loads.
        start_load_kv(this: This, err: Err) -> Status;
        /// Waits for one layer's loads.
        wait_for_layer_load(this: This, layer: u32, err: Err) -> Status;
        /// Saves one layer of these blocks (`block_ids`: `len` u32 block ids).
        save_kv_layer(this: This, layer: u32, block_ids: *const u32, len: usize, err: Err) -> Status;
        /// Waits for this step's saves.
        wait_for_save(this: This, err: Err) -> Status;
        /// `finished` = `len` request ids (UTF-8); `*out` = JSON `FinishedTransfers`.
        get_finished(this: This, finished: *const AbiBytes, len: usize, out: Out, err: Err) -> Status;
        /// `*out` = JSON `Vec<BlockId>`.
        block_ids_with_load_errors(this: This, out: Out, err: Err) -> Status;
        /// `*out` = JSON value, or `null` for none.
        handshake_metadata(this: This, out: Out, err: Err) -> Status;
        /// `peer` = JSON value.
        set_peer_handshake_metadata(this: This, peer: AbiBytes, err: Err) -> Status;
        /// Releases everything (the handle stays valid until `free`).
        shutdown(this: This, err: Err) -> Status;
    }
    optional {}
}

//! [`vtable!`], which turns one list of entries into everything the boundary needs for them.
//! Each vtable's list lives beside its object (`factory.rs`, `scheduler.rs`, `worker.rs`); an
//! entry names the connector-trait method, its Rust parameter types and the C parameters
//! each crosses as (`marshal.rs` says how), and what it returns. From that list come the
//! `#[repr(C)]` struct, the minimum size a host of this major needs, the entries' part of the
//! layout fingerprint, the host's checked copy (`*Fns`: 1.0 entries required, later ones
//! optional, each with its fallback), the C header's declarations (`header.rs`), the
//! plugin-side shim of each entry and the host-side `Foreign*` method that calls it.
//! Adding an entry in a new minor is one line in an `optional` block; one written by hand
//! (`by`) names no fallback value, its host method being written by hand too.
//!
//! Return kinds: none (status only), `json(T)` (a JSON value in `*out`), `bytes` (raw bytes
//! in `*out`), `handle` (`*out` = a new instance). An entry marked `by shim_fn` has its shim
//! and host method written by hand beside the list, for calls that are more than "decode,
//! call, encode" (making instances, the factory's cached `info`).

// Generates the shims and `Foreign*` calls: raw pointers that cross to another library.
#![allow(unsafe_code)]

use super::{AbiBuffer, AbiBytes};
use core::ffi::c_void;

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
#[derive(Debug, Clone)]
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
    pub c_params: Vec<(&'static str, &'static str)>,
}

/// The C parameter `*out` for a return kind, as a `(type, name)` pair (none for status only).
macro_rules! out_param {
    () => {
        None
    };
    (handle) => {
        Some((<*mut *mut c_void as CType>::C, "out"))
    };
    ($kind:ident $(($t:ty))?) => {
        Some((<*mut AbiBuffer as CType>::C, "out"))
    };
}

/// The `*out` type of a return kind as the fingerprint spells it (with its separator).
macro_rules! out_str {
    () => {
        ""
    };
    (handle) => {
        "*mut *mut c_void, "
    };
    ($kind:ident $(($t:ty))?) => {
        "Out, "
    };
}

/// The value a `Foreign*` method returns for a return kind.
macro_rules! ret_ty {
    () => { () };
    (json($t:ty)) => { $t };
    (bytes) => { Vec<u8> };
}

/// The C function-pointer type of an entry.
macro_rules! entry_fn {
    ([$($cty:ty),*], []) => {
        unsafe extern "C" fn(This, $($cty,)* Err) -> Status
    };
    ([$($cty:ty),*], [handle]) => {
        unsafe extern "C" fn(This, $($cty,)* *mut *mut c_void, Err) -> Status
    };
    ([$($cty:ty),*], [$kind:ident $(($t:ty))?]) => {
        unsafe extern "C" fn(This, $($cty,)* Out, Err) -> Status
    };
}

/// The plugin-side shim of a generated entry: decode each argument (`Cross::read`), call the
/// connector method under the panic guard (`call` of the SDK's exported object), write the
/// result and the error. A hand-written entry (`by`) has none.
macro_rules! shim {
    ([by $shim:ident] $($rest:tt)*) => {};
    ([] $exported:ty, $get:ident, $entry:ident, [$($args:tt)*], [$($c:ident : $cty:ty),*], []) => {
        pub(super) unsafe extern "C" fn $entry(this: This, $($c: $cty,)* err: Err) -> Status {
            // SAFETY: a live handle of this plugin's, used as the vtable documents.
            let s = unsafe { $get::<$exported>(this) };
            finish(shim_call!(s, $entry, $($args)*), err, |()| ())
        }
    };
    ([] $exported:ty, $get:ident, $entry:ident, [$($args:tt)*], [$($c:ident : $cty:ty),*], [json($t:ty)]) => {
        pub(super) unsafe extern "C" fn $entry(this: This, $($c: $cty,)* out: Out, err: Err) -> Status {
            // SAFETY: a live handle of this plugin's, used as the vtable documents.
            let s = unsafe { $get::<$exported>(this) };
            let r = shim_call!(s, $entry, $($args)*).and_then(|v: $t| write_json(s.name(), &v, out));
            finish(r, err, |()| ())
        }
    };
    ([] $exported:ty, $get:ident, $entry:ident, [$($args:tt)*], [$($c:ident : $cty:ty),*], [bytes]) => {
        pub(super) unsafe extern "C" fn $entry(this: This, $($c: $cty,)* out: Out, err: Err) -> Status {
            // SAFETY: a live handle of this plugin's, used as the vtable documents.
            let s = unsafe { $get::<$exported>(this) };
            finish(shim_call!(s, $entry, $($args)*), err, |bytes| write_buf(out, bytes))
        }
    };
}

/// Decodes the arguments in order (the first that does not decode is the error) and calls
/// the connector method, guarded.
macro_rules! shim_call {
    ($s:ident, $entry:ident, $($arg:ident : $rty:ty as ($($c:ident : $cty:ty),+)),*) => {
        attempt(|| {
            $(
                // SAFETY: the host's C parameters for this argument, valid for the call.
                let $arg = unsafe { <$rty as Cross>::read($s.name(), ($($c,)+)) }?;
            )*
            $s.call(stringify!($entry), |c| c.$entry($(<$rty as Cross>::lend(&$arg)),*))
        })
    };
}

/// The host-side method of a generated entry, for the `Foreign*` impl of the connector trait;
/// `by` entries are written by hand. `$recv` is `shared` (`&self`) or `unique` (`&mut self`);
/// `$fallback`, for entries a plugin may lack, is what the method returns then.
macro_rules! foreign_fn {
    ([by $shim:ident] $($rest:tt)*) => {};
    ([] unique, $entry:ident, [$($arg:ident : $rty:ty as $cs:tt),*], [$($ret:tt)*], $opt:tt) => {
        fn $entry(&mut self, $($arg: $rty),*) -> ConnectorResult<ret_ty!($($ret)*)> {
            foreign_entry!(self, $entry, [$($arg : $rty as $cs),*], [$($ret)*], $opt)
        }
    };
    ([] shared, $entry:ident, [$($arg:ident : $rty:ty as $cs:tt),*], [$($ret:tt)*], $opt:tt) => {
        fn $entry(&self, $($arg: $rty),*) -> ConnectorResult<ret_ty!($($ret)*)> {
            foreign_entry!(self, $entry, [$($arg : $rty as $cs),*], [$($ret)*], $opt)
        }
    };
}

/// A required entry is called; an optional one when the plugin has it, else its fallback.
macro_rules! foreign_entry {
    ($s:ident, $entry:ident, [$($arg:ident : $rty:ty as $cs:tt),*], [$($ret:tt)*], []) => {
        foreign_call!($s, $entry, $s.fns().$entry, [$($arg : $rty as $cs),*], [$($ret)*])
    };
    ($s:ident, $entry:ident, [$($arg:ident : $rty:ty as $cs:tt),*], [$($ret:tt)*], [$fallback:expr]) => {
        match $s.fns().$entry {
            Some(f) => foreign_call!($s, $entry, f, [$($arg : $rty as $cs),*], [$($ret)*]),
            None => {
                let _ = ($($arg,)*);
                $fallback
            }
        }
    };
}

/// Prepares the arguments (`Cross::hold`, kept alive across the call), passes their C
/// parameters, and reads the result and the error.
macro_rules! foreign_call {
    (
        $s:ident, $entry:ident, $f:expr,
        [$($arg:ident : $rty:ty as ($($c:ident : $cty:ty),+)),*], [$($ret:tt)*]
    ) => {{
        $( let $arg = <$rty as Cross>::hold($arg, || $s.name())?; )*
        $( let ($($c,)+) = <$rty as Cross>::c(&$arg); )*
        let (f, h) = ($f, $s.raw_handle());
        foreign_ret!($s, $entry, f, h, [$($($c),+),*], [$($ret)*])
    }};
}

macro_rules! foreign_ret {
    ($s:ident, $entry:ident, $f:ident, $h:ident, [$($c:ident),*], []) => {
        // SAFETY: a live instance of this plugin, used from this thread as its vtable says; the
        // arguments' C parameters point into values that live across the call.
        call_status(|| $s.name(), |err| unsafe { $f($h, $($c,)* err) })
    };
    ($s:ident, $entry:ident, $f:ident, $h:ident, [$($c:ident),*], [json($t:ty)]) => {
        // SAFETY: as above.
        call_json(|| $s.name(), stringify!($entry), |out, err| unsafe { $f($h, $($c,)* out, err) })
    };
    ($s:ident, $entry:ident, $f:ident, $h:ident, [$($c:ident),*], [bytes]) => {
        // SAFETY: as above.
        call_out(|| $s.name(), |out, err| unsafe { $f($h, $($c,)* out, err) })
            .map(|out| out.as_bytes().to_vec())
    };
}

/// One vtable from its list of entries; see the module doc. The `free` entry comes first in
/// every vtable and is implied: it frees the plugin's exported object.
macro_rules! vtable {
    (
        $(#[doc = $sdoc:literal])*
        $name:ident, checked $checked:ident, c $cname:literal, free $freedoc:literal,
        plugin $exported:ty, via $get:ident,
        host impl $trait:ident for $foreign:ident, $recv:ident {
            $(
                $(#[doc = $doc:literal])*
                $entry:ident ( $($arg:ident : $rty:ty as ($($c:ident : $cty:ty),+)),* )
                    $(-> $rk:ident $(($rt:ty))?)? $(, by $shim:ident)?;
            )*
        }
        optional {
            $(
                $(#[doc = $odoc:literal])*
                #[since(1, $minor:literal)] $(#[cfg($cfg:meta)])?
                $oentry:ident ( $($oarg:ident : $orty:ty as ($($oc:ident : $octy:ty),+)),* )
                    $(-> $ork:ident $(($ort:ty))?)?,
                    else $fallback:literal $(=> $fbexpr:expr)? $(, by $oshim:ident)?;
            )*
        }
        by hand { $($manual:tt)* }
    ) => {
        $(#[doc = $sdoc])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy)]
        pub struct $name {
            /// `size_of` this struct as the plugin was built: which entries it has.
            pub struct_size: usize,
            #[doc = $freedoc]
            pub free: Option<unsafe extern "C" fn(this: This)>,
            $(
                $(#[doc = $doc])*
                pub $entry: Option<entry_fn!([$($($cty),+),*], [$($rk $(($rt))?)?])>,
            )*
            $(
                $(#[doc = $odoc])*
                #[doc = concat!(
                    "\n\nSince 1.", $minor, "; may be null (or absent, in an older plugin): ", $fallback
                )]
                $(#[cfg($cfg)])?
                pub $oentry: Option<entry_fn!([$($($octy),+),*], [$($ork $(($ort))?)?])>,
            )*
        }

        // SAFETY: a usize and `Option`s of function pointers, all valid as zero.
        unsafe impl Versioned for $name {}

        impl $name {
            /// The C name of the struct.
            pub const C_NAME: &'static str = $cname;

            /// Bytes of it a host of this major calls: up to the last `.0` entry.
            pub const MIN_SIZE: usize = {
                let mut end = offset_of!($name, free) + size_of::<usize>();
                $(
                    let e = offset_of!($name, $entry) + size_of::<usize>();
                    if e > end {
                        end = e;
                    }
                )*
                end
            };

            /// Bytes of it that a plugin of minor `minor` exports at least: up to the last
            /// entry of that minor or an earlier one. For a minor newer than this host's, the
            /// entries this host knows.
            pub const fn min_size_for_minor(minor: u16) -> usize {
                #[allow(unused_mut)] // a vtable without later entries never grows it
                let mut end = Self::MIN_SIZE;
                $(
                    $(#[cfg($cfg)])?
                    {
                        let e = offset_of!($name, $oentry) + size_of::<usize>();
                        if $minor <= minor && e > end {
                            end = e;
                        }
                    }
                )*
                let _ = minor;
                end
            }

            /// The SDK's shims, as a plugin exports them.
            pub const EXPORTED: $name = $name {
                struct_size: size_of::<$name>(),
                free: Some(free_exported::<$exported>),
                $( $entry: Some(shim_name!($entry $(, $shim)?)), )*
                $( $(#[cfg($cfg)])? $oentry: Some(shim_name!($oentry $(, $oshim)?)), )*
            };

            /// Folds the `.0` layout into the fingerprint: alignment, each entry's offset and
            /// parameter types, where they end. Not the struct's size, which later minors grow.
            pub(crate) const fn fold_layout(h: u64) -> u64 {
                let mut h = mix(h, core::mem::align_of::<$name>());
                h = mix(h, offset_of!($name, struct_size));
                h = mix(h, offset_of!($name, free));
                h = mix_str(h, "(This)");
                $(
                    h = mix(h, offset_of!($name, $entry));
                    h = mix_str(h, concat!(
                        "(This, ", $($(stringify!($cty), ", ",)+)* out_str!($($rk $(($rt))?)?), "Err) -> \
                            Status"
                    ));
                )*
                mix(h, Self::MIN_SIZE)
            }

            /// Every entry, in order.
            pub fn entries() -> Vec<EntryInfo> {
                let mut v = vec![EntryInfo {
                    name: "free",
                    offset: offset_of!($name, free),
                    since_minor: 0,
                    fallback: None,
                    doc: &[$freedoc],
                    c_ret: "void",
                    c_params: vec![(<This as CType>::C, "this")],
                }];
                $(
                    v.push(EntryInfo {
                        name: stringify!($entry),
                        offset: offset_of!($name, $entry),
                        since_minor: 0,
                        fallback: None,
                        doc: &[$($doc),*],
                        c_ret: <Status as CType>::C,
                        c_params: EntryInfo::c_params(
                            &[$($((<$cty as CType>::C, stringify!($c))),+),*],
                            out_param!($($rk $(($rt))?)?),
                        ),
                    });
                )*
                $(
                    $(#[cfg($cfg)])?
                    v.push(EntryInfo {
                        name: stringify!($oentry),
                        offset: offset_of!($name, $oentry),
                        since_minor: $minor,
                        fallback: Some($fallback),
                        doc: &[$($odoc),*],
                        c_ret: <Status as CType>::C,
                        c_params: EntryInfo::c_params(
                            &[$($((<$octy as CType>::C, stringify!($oc))),+),*],
                            out_param!($($ork $(($ort))?)?),
                        ),
                    });
                )*
                v
            }
        }

        #[doc = concat!("A checked copy of a plugin's `", stringify!($name), "`: every `.0` entry present, \
            later ones optional.")]
        #[derive(Debug, Clone, Copy)]
        pub struct $checked {
            #[doc = concat!("`", stringify!($name), "::free`.")]
            pub free: unsafe extern "C" fn(this: This),
            $(
                #[doc = concat!("`", stringify!($name), "::", stringify!($entry), "`.")]
                pub $entry: entry_fn!([$($($cty),+),*], [$($rk $(($rt))?)?]),
            )*
            $(
                #[doc = concat!("`", stringify!($name), "::", stringify!($oentry), "`; absent: ", $fallback)]
                $(#[cfg($cfg)])?
                pub $oentry: Option<entry_fn!([$($($octy),+),*], [$($ork $(($ort))?)?])>,
            )*
        }

        impl $checked {
            /// Checks that every `.0` entry is there; names the first one missing.
            pub fn check(vt: &$name) -> Result<$checked, &'static str> {
                Ok($checked {
                    free: vt.free.ok_or("free")?,
                    $( $entry: vt.$entry.ok_or(stringify!($entry))?, )*
                    $( $(#[cfg($cfg)])? $oentry: vt.$oentry, )*
                })
            }
        }

        /// The plugin-side shims of the generated entries.
        mod shims {
            use super::*;
            $(
                shim!([$(by $shim)?] $exported, $get, $entry,
                    [$($arg : $rty as ($($c : $cty),+)),*], [$($($c : $cty),+),*], [$($rk $(($rt))?)?]);
            )*
            $(
                $(#[cfg($cfg)])?
                shim!([$(by $oshim)?] $exported, $get, $oentry,
                    [$($oarg : $orty as ($($oc : $octy),+)),*], [$($($oc : $octy),+),*],
                    [$($ork $(($ort))?)?]);
            )*
        }

        impl $trait for $foreign {
            $(
                foreign_fn!([$(by $shim)?] $recv, $entry,
                    [$($arg : $rty as ($($c : $cty),+)),*], [$($rk $(($rt))?)?], []);
            )*
            $(
                $(#[cfg($cfg)])?
                foreign_fn!([$(by $oshim)?] $recv, $oentry,
                    [$($oarg : $orty as ($($oc : $octy),+)),*], [$($ork $(($ort))?)?], [$($fbexpr)?]);
            )*
            $($manual)*
        }
    };
}

/// The shim an entry's `EXPORTED` slot holds: the generated one, or the hand-written one.
macro_rules! shim_name {
    ($entry:ident) => {
        shims::$entry
    };
    ($entry:ident, $shim:ident) => {
        $shim
    };
}

impl EntryInfo {
    /// `this`, the entry's own parameters, `*out` if it has one, and `err`.
    pub fn c_params(
        own: &[(&'static str, &'static str)],
        out: Option<(&'static str, &'static str)>,
    ) -> Vec<(&'static str, &'static str)> {
        let mut p = vec![(<This as CType>::C, "this")];
        p.extend_from_slice(own);
        p.extend(out);
        p.push((<Err as CType>::C, "err"));
        p
    }
}

/// The `free` entry every vtable starts with: drops the exported object `this` points to.
///
/// # Safety
/// `this` is null or a `Box<T>` this library made (`Box::into_raw`), freed once.
pub(super) unsafe extern "C" fn free_exported<T>(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(this as *mut T) });
    }
}

pub(super) type This = *mut c_void;
pub(super) type Out = *mut AbiBuffer;
pub(super) type Err = *mut AbiBuffer;

//! The plugin side's calling convention, shared by every shim: results and errors written
//! to the host's out-parameters, JSON arguments read, handles borrowed.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::*;
use core::ffi::c_void;

/// Writes `r` to the out-parameters: the value through `write_ok`, an error as JSON.
#[inline]
pub(super) fn finish<T>(
    r: Result<T, ConnectorError>,
    err: *mut AbiBuffer,
    write_ok: impl FnOnce(T),
) -> Status {
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

/// Runs `f`, which decodes a call's arguments (`?` on the first that does not decode) and
/// calls the connector.
#[inline]
pub(super) fn attempt<T>(f: impl FnOnce() -> Result<T, ConnectorError>) -> Result<T, ConnectorError> {
    f()
}

/// Writes a JSON-encoded value to `out`.
pub(super) fn write_json<T: serde::Serialize>(
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

pub(super) fn write_buf(out: *mut AbiBuffer, bytes: Vec<u8>) {
    if !out.is_null() {
        // SAFETY: the host passes a valid, writable out-parameter (or null, checked).
        unsafe { out.write(AbiBuffer::from_vec(bytes)) };
    }
}

pub(super) fn read_json<T: serde::de::DeserializeOwned>(
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
pub(super) unsafe fn handle<'a, T>(this: *mut c_void) -> &'a mut T {
    // SAFETY: the caller's contract.
    unsafe { &mut *(this as *mut T) }
}

/// # Safety
/// `this` must be a live handle of type `T` from this library that may be shared between
/// threads (a factory).
pub(super) unsafe fn shared<'a, T>(this: *mut c_void) -> &'a T {
    // SAFETY: the caller's contract.
    unsafe { &*(this as *const T) }
}

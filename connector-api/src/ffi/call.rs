//! The host side's calling convention, shared by every `Foreign*` method: a status and an
//! error buffer per call, output buffers taken over, JSON results decoded, the error
//! rebuilt as the plugin's `ConnectorError`.

#![allow(unsafe_code)] // Takes over buffers the plugin filled.

use super::*;
use crate::error::ConnectorError;
use crate::ConnectorResult;
use core::ffi::c_void;

pub(super) type ErrOut = *mut AbiBuffer;
pub(super) type Handle = *mut c_void;

/// What keeps a plugin's code mapped, and its checked entries: the host's loaded library.
pub trait PluginCode: Send + Sync + 'static {
    /// The entries, checked by the loader.
    fn entries(&self) -> &PluginEntries;
}

/// A plugin's checked entries: its connector name, `factory_new` and the three vtables
/// (1.0 entries required, later ones optional; see `vtables`).
#[derive(Debug, Clone)]
pub struct PluginEntries {
    /// The connector name it registers (for messages).
    pub name: String,
    /// `factory_new`.
    pub factory_new: FactoryNewFn,
    /// The factory's entries.
    pub factory_vt: FactoryFns,
    /// The scheduler half's entries.
    pub scheduler_vt: SchedulerFns,
    /// The worker half's entries.
    pub worker_vt: WorkerFns,
}

/// Runs one call that reports through a status and an error buffer. The connector's name is
/// only looked up on the error path: the success path is the per-step hot path.
#[inline]
pub fn call_status<'a>(
    connector: impl FnOnce() -> &'a str,
    f: impl FnOnce(ErrOut) -> Status,
) -> ConnectorResult<()> {
    let mut err = AbiBuffer::empty();
    let st = f(&mut err);
    if st == status::OK && err.free.is_none() {
        return Ok(());
    }
    // SAFETY: `err` is empty or was filled by the plugin, which hands ownership to us.
    let err = unsafe { ReceivedBuffer::new(err) };
    if st == status::OK {
        return Ok(());
    }
    Err(decode_error(connector(), st, err.as_bytes()))
}

/// Runs one call that also fills an output buffer.
pub(super) fn call_out<'a>(
    connector: impl FnOnce() -> &'a str,
    f: impl FnOnce(*mut AbiBuffer, ErrOut) -> Status,
) -> ConnectorResult<ReceivedBuffer> {
    let mut out = AbiBuffer::empty();
    let r = call_status(connector, |err| f(&mut out, err));
    // SAFETY: `out` is empty or was filled by the plugin; either way it is ours to free.
    let out = unsafe { ReceivedBuffer::new(out) };
    r.map(|()| out)
}

pub(super) fn call_json<'a, T: serde::de::DeserializeOwned>(
    connector: impl Fn() -> &'a str,
    method: &str,
    f: impl FnOnce(*mut AbiBuffer, ErrOut) -> Status,
) -> ConnectorResult<T> {
    let out = call_out(&connector, f)?;
    serde_json::from_slice(out.as_bytes()).map_err(|e| ConnectorError::Other {
        connector: connector().to_owned(),
        message: format!(
            "plugin returned a {method} result the host cannot decode ({e}); is it built against another \
                kvconnect-api?"
        ),
    })
}

pub(super) fn decode_error(connector: &str, st: Status, bytes: &[u8]) -> ConnectorError {
    if let Ok(e) = serde_json::from_slice::<ConnectorError>(bytes) {
        return e;
    }
    let text = String::from_utf8_lossy(bytes);
    let message =
        if text.is_empty() { format!("failed with status {st} and no message") } else { text.into_owned() };
    match st {
        status::POISONED => ConnectorError::Poisoned { connector: connector.to_owned(), message },
        status::PANICKED => ConnectorError::Panicked {
            connector: connector.to_owned(),
            method: "a plugin call".into(),
            message,
        },
        _ => ConnectorError::Other { connector: connector.to_owned(), message },
    }
}

/// Encodes an argument; `connector` names the plugin in an error.
pub(super) fn to_json<'n, T: serde::Serialize + ?Sized>(
    connector: impl FnOnce() -> &'n str,
    v: &T,
) -> ConnectorResult<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| ConnectorError::Other {
        connector: connector().to_owned(),
        message: format!("cannot encode an argument for the plugin: {e}"),
    })
}

pub(super) fn bytes(b: &[u8]) -> AbiBytes {
    AbiBytes::from_slice(b)
}

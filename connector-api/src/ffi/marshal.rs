//! How each kind of argument crosses the boundary: one [`Cross`] impl per Rust parameter type
//! of the connector traits says which C parameters carry it, what the host keeps alive for
//! the call, and how the plugin side rebuilds it. The `vtable!` lists name only the Rust
//! type; the shims and the `Foreign*` methods they generate go through these impls.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::call::to_json;
use super::shim::read_json;
use super::AbiBytes;
use crate::connector::{BlocksPerGroup, Request, StepInfo};
use crate::error::ConnectorError;
use crate::ids::{BlockId, LayerId, RequestId};
use crate::model::ModelSpec;
use crate::region::{KvRegion, KvRegionSpec};
use crate::{ConnectorResult, KvTransferConfig};

/// A connector-method parameter of type `Self`, as it crosses.
pub trait Cross<'a>: Sized {
    /// The C parameters that carry it, as a tuple, in the entry's order.
    type C;
    /// What the host keeps alive across the call (the C parameters point into it).
    type Held;
    /// What the plugin side rebuilds, valid for the call.
    type Owned: 'a;
    /// Host side: prepares the value; `connector` names the plugin in an error.
    fn hold<'n>(v: Self, connector: impl FnOnce() -> &'n str) -> ConnectorResult<Self::Held>;
    /// Host side: the C parameters, pointing into `held`.
    fn c(held: &Self::Held) -> Self::C;
    /// Plugin side: rebuilds the value from the host's C parameters.
    ///
    /// # Safety
    /// `c` must be what the host passed for this parameter, valid for the call.
    unsafe fn read(connector: &str, c: Self::C) -> Result<Self::Owned, ConnectorError>;
    /// Plugin side: the parameter the connector method takes.
    fn lend(o: &'a Self::Owned) -> Self;
}

/// A value that crosses as JSON bytes; `WHAT` names it when they do not decode.
pub trait JsonArg: serde::Serialize + serde::de::DeserializeOwned {
    /// As the plugin's error says it: "the host sent a {WHAT} that does not decode".
    const WHAT: &'static str;
}

macro_rules! json_args {
    ($($t:ty => $what:literal),* $(,)?) => { $(impl JsonArg for $t { const WHAT: &'static str = $what; })* };
}

json_args! {
    Request => "request",
    BlocksPerGroup => "block list",
    StepInfo => "step",
    KvTransferConfig => "kv-transfer-config",
    serde_json::Value => "peer handshake metadata",
}

impl<'a, T: JsonArg + 'a> Cross<'a> for &'a T {
    type C = (AbiBytes,);
    type Held = Vec<u8>;
    type Owned = T;
    fn hold<'n>(v: Self, connector: impl FnOnce() -> &'n str) -> ConnectorResult<Vec<u8>> {
        to_json(connector, v)
    }
    fn c(held: &Vec<u8>) -> (AbiBytes,) {
        (AbiBytes::from_slice(held),)
    }
    unsafe fn read(connector: &str, (b,): (AbiBytes,)) -> Result<T, ConnectorError> {
        read_json(connector, T::WHAT, b)
    }
    fn lend(o: &'a T) -> Self {
        o
    }
}

/// The model: JSON, or empty bytes for none.
impl<'a> Cross<'a> for Option<&'a ModelSpec> {
    type C = (AbiBytes,);
    type Held = Vec<u8>;
    type Owned = Option<ModelSpec>;
    fn hold<'n>(v: Self, connector: impl FnOnce() -> &'n str) -> ConnectorResult<Vec<u8>> {
        v.map_or(Ok(Vec::new()), |m| to_json(connector, m))
    }
    fn c(held: &Vec<u8>) -> (AbiBytes,) {
        (AbiBytes::from_slice(held),)
    }
    unsafe fn read(connector: &str, (b,): (AbiBytes,)) -> Result<Option<ModelSpec>, ConnectorError> {
        if b.len == 0 {
            Ok(None)
        } else {
            read_json(connector, "model spec", b).map(Some)
        }
    }
    fn lend(o: &'a Option<ModelSpec>) -> Self {
        o.as_ref()
    }
}

/// Regions cross as their JSON specs; the plugin side vouches for them again on the host's
/// word (`WorkerVTable::register_kv_caches`).
impl<'a> Cross<'a> for &'a [KvRegion] {
    type C = (AbiBytes,);
    type Held = Vec<u8>;
    type Owned = Vec<KvRegion>;
    fn hold<'n>(v: Self, connector: impl FnOnce() -> &'n str) -> ConnectorResult<Vec<u8>> {
        // The regions' memory outlives this instance (`KvRegion::new`'s contract): the promise
        // the plugin side relies on when it turns these specs back into regions.
        to_json(connector, &v)
    }
    fn c(held: &Vec<u8>) -> (AbiBytes,) {
        (AbiBytes::from_slice(held),)
    }
    unsafe fn read(connector: &str, (b,): (AbiBytes,)) -> Result<Vec<KvRegion>, ConnectorError> {
        let specs: Vec<KvRegionSpec> = read_json(connector, "region list", b)?;
        Ok(specs
            .into_iter()
            // SAFETY: the contract of `register_kv_caches`: the host sends only regions made
            // with `KvRegion::new`, and keeps their memory valid until it frees this instance,
            // with which the connector's views of them go.
            .map(|spec| unsafe { KvRegion::vouched(spec) })
            .collect())
    }
    fn lend(o: &'a Vec<KvRegion>) -> Self {
        o
    }
}

/// Raw bytes (the scheduler's metadata), borrowed for the call.
impl<'a> Cross<'a> for &'a [u8] {
    type C = (AbiBytes,);
    type Held = &'a [u8];
    type Owned = &'a [u8];
    fn hold<'n>(v: Self, _: impl FnOnce() -> &'n str) -> ConnectorResult<&'a [u8]> {
        Ok(v)
    }
    fn c(held: &&'a [u8]) -> (AbiBytes,) {
        (AbiBytes::from_slice(held),)
    }
    unsafe fn read(_: &str, (b,): (AbiBytes,)) -> Result<&'a [u8], ConnectorError> {
        // SAFETY: the host's bytes are valid for the call (the caller's contract).
        Ok(unsafe { b.as_slice() })
    }
    fn lend(o: &'a &'a [u8]) -> Self {
        o
    }
}

/// A count (`usize`) as a u64.
impl<'a> Cross<'a> for usize {
    type C = (u64,);
    type Held = u64;
    type Owned = usize;
    fn hold<'n>(v: Self, _: impl FnOnce() -> &'n str) -> ConnectorResult<u64> {
        Ok(v as u64)
    }
    fn c(held: &u64) -> (u64,) {
        (*held,)
    }
    unsafe fn read(_: &str, (n,): (u64,)) -> Result<usize, ConnectorError> {
        Ok(n as usize)
    }
    fn lend(o: &'a usize) -> Self {
        *o
    }
}

/// A layer as its u32.
impl<'a> Cross<'a> for LayerId {
    type C = (u32,);
    type Held = u32;
    type Owned = LayerId;
    fn hold<'n>(v: Self, _: impl FnOnce() -> &'n str) -> ConnectorResult<u32> {
        Ok(v.0)
    }
    fn c(held: &u32) -> (u32,) {
        (*held,)
    }
    unsafe fn read(_: &str, (l,): (u32,)) -> Result<LayerId, ConnectorError> {
        Ok(LayerId(l))
    }
    fn lend(o: &'a LayerId) -> Self {
        *o
    }
}

/// Block ids as a u32 array and its length, borrowed for the call (the per-layer hot path:
/// nothing is copied).
impl<'a> Cross<'a> for &'a [BlockId] {
    type C = (*const u32, usize);
    type Held = &'a [BlockId];
    type Owned = &'a [BlockId];
    fn hold<'n>(v: Self, _: impl FnOnce() -> &'n str) -> ConnectorResult<&'a [BlockId]> {
        Ok(v)
    }
    fn c(held: &&'a [BlockId]) -> (*const u32, usize) {
        // `BlockId` is `repr(transparent)` over u32, so the slice is an array of u32.
        (held.as_ptr() as *const u32, held.len())
    }
    unsafe fn read(_: &str, (ptr, len): (*const u32, usize)) -> Result<&'a [BlockId], ConnectorError> {
        if len == 0 || ptr.is_null() {
            return Ok(&[]);
        }
        // SAFETY: the host passes `len` block ids valid for the call (the caller's contract);
        // `BlockId` is `repr(transparent)` over u32, so the cast keeps size and alignment.
        Ok(unsafe { core::slice::from_raw_parts(ptr as *const BlockId, len) })
    }
    fn lend(o: &'a &'a [BlockId]) -> Self {
        o
    }
}

/// Request ids as an array of UTF-8 byte strings and its length.
impl<'a> Cross<'a> for &'a [RequestId] {
    type C = (*const AbiBytes, usize);
    type Held = Vec<AbiBytes>;
    type Owned = Vec<RequestId>;
    fn hold<'n>(v: Self, _: impl FnOnce() -> &'n str) -> ConnectorResult<Vec<AbiBytes>> {
        // Borrows the ids' strings, which outlive the call.
        Ok(v.iter().map(|r| AbiBytes::from_slice(r.0.as_bytes())).collect())
    }
    fn c(held: &Vec<AbiBytes>) -> (*const AbiBytes, usize) {
        (held.as_ptr(), held.len())
    }
    unsafe fn read(_: &str, (ptr, len): (*const AbiBytes, usize)) -> Result<Vec<RequestId>, ConnectorError> {
        let ids: &[AbiBytes] = if len == 0 || ptr.is_null() {
            &[]
        } else {
            // SAFETY: the host passes `len` request ids valid for the call.
            unsafe { core::slice::from_raw_parts(ptr, len) }
        };
        // SAFETY: each id's bytes are valid for the call.
        Ok(ids.iter().map(|b| RequestId(unsafe { b.to_string_lossy() })).collect())
    }
    fn lend(o: &'a Vec<RequestId>) -> Self {
        o
    }
}

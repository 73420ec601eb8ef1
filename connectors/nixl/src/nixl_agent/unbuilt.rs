//! The NIXL agent in a build without feature `nixl`: no agent can exist. [`NixlAgent::new`]
//! always fails with [`NixlLibError::NotBuilt`], so the types below are uninhabited and every
//! method is unreachable; they keep the callers free of feature gates.

#![allow(unsafe_code)] // NIXL bindings: the same unsafe signatures when NIXL is not built.

use super::{NixlCallError, NixlMem, ReadPair};
use crate::nixl_lib::NixlLibError;

/// A NIXL agent; none exists in this build.
#[derive(Debug)]
pub enum NixlAgent {}

/// A registered memory range; none exists in this build.
#[derive(Debug)]
pub enum Registration {}

/// A prepared descriptor list; none exists in this build.
#[derive(Debug, PartialEq, Eq)]
pub enum Prepared {}

impl Prepared {
    /// Its entries.
    pub fn entries(&self) -> usize {
        match *self {}
    }
}

/// A posted transfer; none exists in this build.
#[derive(Debug)]
pub enum Transfer {}

impl Transfer {
    /// Bytes it moves.
    pub fn bytes(&self) -> u64 {
        match *self {}
    }

    /// Descriptors it was built from.
    pub fn descriptors(&self) -> usize {
        match *self {}
    }
}

impl NixlAgent {
    /// Always fails: this build has no NIXL support.
    pub fn new(_name: &str) -> Result<NixlAgent, NixlCallError> {
        Err(NixlLibError::NotBuilt.into())
    }

    /// Unreachable: no agent exists.
    pub fn supports(&self, _mem: NixlMem) -> bool {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn memory_types(&self) -> String {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn name(&self) -> &str {
        match *self {}
    }

    /// Unreachable: no agent exists.
    ///
    /// # Safety
    /// As the real agent's: the range must stay valid while the agent lives.
    pub unsafe fn register_dram(&self, _addr: usize, _len: usize) -> Result<Registration, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    ///
    /// # Safety
    /// As the real agent's: the range must stay valid while the agent lives.
    pub unsafe fn register(
        &self,
        _addr: usize,
        _len: usize,
        _mem: NixlMem,
    ) -> Result<Registration, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn local_md(&self) -> Result<Vec<u8>, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn load_remote_md(&self, _md: &[u8]) -> Result<String, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn invalidate_remote(&self, _remote: &str) {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn post_read(&self, _remote: &str, _pairs: &[ReadPair]) -> Result<Transfer, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn post_read_mem(
        &self,
        _remote: &str,
        _pairs: &[ReadPair],
        _local_mem: NixlMem,
        _far_mem: NixlMem,
    ) -> Result<Transfer, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn prepare(
        &self,
        _remote: Option<&str>,
        _ranges: &[(usize, usize)],
        _mem: NixlMem,
    ) -> Result<Prepared, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn release_prepared(&self, _p: Prepared) {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn post_read_prepared(
        &self,
        _local: &Prepared,
        _local_idx: &[i32],
        _far: &Prepared,
        _far_idx: &[i32],
        _bytes: u64,
    ) -> Result<Transfer, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn poll(&self, _t: &Transfer) -> Result<bool, NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn notify(&self, _remote: &str, _msg: &[u8]) -> Result<(), NixlCallError> {
        match *self {}
    }

    /// Unreachable: no agent exists.
    pub fn take_notifications(&self) -> Result<Vec<(String, String)>, NixlCallError> {
        match *self {}
    }
}

//! What every data plane shares, whatever connector moves the KV (ARCHITECTURE.md §1): the
//! per-deployment secret and the HMAC proofs its connections open with (`auth`), and random
//! bytes and their hex (`auth::random_bytes`, `hex`).
//!
//! It holds no connector: the connectors and the host depend on it.

pub mod auth;
pub mod hex;

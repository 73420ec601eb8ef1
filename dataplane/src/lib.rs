//! What every data plane shares, whatever connector moves the KV (ARCHITECTURE.md §1): the
//! per-deployment secret and the HMAC proofs its connections open with (`auth`), random
//! bytes and their hex (`auth::random_bytes`, `hex`), the POSIX shared-memory segments KV
//! regions live in (`shm`), and vLLM's remote-decode request parameters (`params`).
//!
//! It holds no connector: the connectors and the host depend on it, and it depends on
//! `kvconnect-api` alone.

pub mod auth;
pub mod hex;
pub mod params;
pub mod shm;

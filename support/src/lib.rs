//! What kvconnect's connectors, engine, host and benchmarks share beyond the contract: the
//! effects and helpers that `kvconnect-api` leaves out.
//!
//! - [`cache_metrics`]: the metric families every cache connector reports alike.
//! - [`stats`]: the benchmarks' method (interleaved baseline/subject pairs, quartiles) and the
//!   machine a figure was measured on (cores, load average from `/proc/loadavg`).
//! - [`host_buffer`]: host memory for bulk copies, zeroed anonymous mappings on transparent
//!   huge pages where the kernel gives them.
//! - [`stable_hash`]: 64-bit hashes and payload checksums that are the same in every process.
//! - [`frame`]: length-prefixed JSON frames, the side channel's and the nixl producer's.
//! - [`peer_slots`]: what a decode remembers of each prefill it handshakes with.
//! - [`stream_copy`]: copies with non-temporal (streaming) stores, for runs and rows larger
//!   than the caches.
//!
//! The contract itself (data, pure functions, the connector traits and the plugin ABI) stays
//! in `kvconnect-api`, which this crate depends on and which never depends on it; a plugin
//! needs only that.

pub mod cache_metrics;
pub mod frame;
pub mod host_buffer;
pub mod peer_slots;
pub mod stable_hash;
pub mod stats;
pub mod stream_copy;

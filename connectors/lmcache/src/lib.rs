//! LMCache-style chunked prefix cache with CPU and disk tiers.

pub mod caps;

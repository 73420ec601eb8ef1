//! FlexKV-style radix-tree block cache with CPU and SSD tiers.

pub mod caps;

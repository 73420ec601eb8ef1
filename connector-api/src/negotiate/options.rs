//! The engine options negotiation reads, and the children it reads them for.

use crate::caps::{Capabilities, MemoryKind};
use crate::layout::KvLayout;
use crate::model::Dtype;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The hybrid KV cache manager setting (vLLM's `--disable-hybrid-kv-cache-manager`, as a
/// tri-state so "let negotiation decide" is the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HmaOption {
    /// On iff every child supports it and it changes the KV cache groups.
    #[default]
    Auto,
    /// On; a child that does not support it is a conflict.
    On,
    /// Off; a model with state-space or linear-attention layers then cannot run.
    Off,
}

/// An engine option string that names no valid value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{option}: '{input}' is not a valid value; expected {expected}")]
pub struct OptionParseError {
    /// The option.
    pub option: String,
    /// What was given.
    pub input: String,
    /// The valid values.
    pub expected: String,
}

impl FromStr for HmaOption {
    type Err = OptionParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(HmaOption::Auto),
            "on" | "true" => Ok(HmaOption::On),
            "off" | "false" => Ok(HmaOption::Off),
            _ => Err(OptionParseError {
                option: "hybrid_kv_cache_manager".to_owned(),
                input: s.to_owned(),
                expected: "auto, on or off (or true/false)".to_owned(),
            }),
        }
    }
}

impl fmt::Display for HmaOption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HmaOption::Auto => "auto",
            HmaOption::On => "on",
            HmaOption::Off => "off",
        })
    }
}

/// The engine options negotiation reads. `None` means "not set by the user".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineOptions {
    /// Hybrid KV cache manager; default `Auto`.
    pub hybrid_kv_cache_manager: HmaOption,
    /// User override of the KV layout.
    pub kv_cache_layout: Option<KvLayout>,
    /// User override of the block size; 16 when unset (vLLM's default).
    pub block_size: Option<u32>,
    /// `None` = "auto": the model's dtype, else bf16.
    pub cache_dtype: Option<Dtype>,
    /// Where the KV cache lives (from `kv_buffer_device`); host when unset.
    pub memory: Option<MemoryKind>,
    /// Tensor-parallel size; default 1.
    pub tp_size: u32,
    /// This worker's tensor-parallel rank; default 0.
    pub tp_rank: u32,
    /// Whether a child may adapt its own data path to a layout it does not accept.
    pub allow_adapters: bool,
    /// The engine's in-block order is its own (`Some(why)`), e.g. vLLM's CPU attention backend,
    /// which stores K transposed inside a block. `kv_cache_layout` then only says where whole
    /// blocks are; blocks move whole and are never adapted, so a layout adapter is a conflict.
    pub opaque_blocks: Option<String>,
    /// How many tensor-parallel ranks one worker connector serves: 1 where every rank has its
    /// own connector (vLLM), `tp_size` where the ranks share one (kvconnect's reference
    /// engine, whose ranks are threads of one process). Above 1, every child must declare
    /// `ranks_in_one_worker`. Default 1.
    pub ranks_per_worker: u32,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            hybrid_kv_cache_manager: HmaOption::Auto,
            kv_cache_layout: None,
            block_size: None,
            cache_dtype: None,
            memory: None,
            tp_size: 1,
            tp_rank: 0,
            allow_adapters: true,
            opaque_blocks: None,
            ranks_per_worker: 1,
        }
    }
}

impl EngineOptions {
    /// Maps vLLM's `kv_buffer_device` (`cpu`, `cuda`, ...) to a memory kind.
    pub fn memory_from_kv_buffer_device(s: &str) -> Result<MemoryKind, OptionParseError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" | "host" => Ok(MemoryKind::Host),
            "cuda" | "gpu" | "device" | "xpu" => Ok(MemoryKind::Device),
            "disk" => Ok(MemoryKind::Disk),
            _ => Err(OptionParseError {
                option: "kv_buffer_device".to_owned(),
                input: s.to_owned(),
                expected: "cpu or cuda".to_owned(),
            }),
        }
    }
}

/// One child connector as negotiation sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildCaps {
    /// The child's name (`nixl`, `lmcache`, ...), used in every message.
    pub name: String,
    /// The child's version, for descriptors and messages.
    pub version: String,
    /// What it declared.
    pub caps: Capabilities,
}

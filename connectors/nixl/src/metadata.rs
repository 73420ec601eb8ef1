//! Handshake metadata: what a producer publishes (`handshake_metadata`) and what a consumer
//! keeps of it per peer engine (`set_peer_handshake_metadata`, the host's handshake envelope
//! `{"engine_id", "peer", "plan", "peer_effective"}`; ARCHITECTURE.md §6 and §7).

use crate::config::NAME;
use kvconnect_api::compat::AdaptationPlan;
use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{ConnectorError, KvLayout, LayerId};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::net::{SocketAddr, ToSocketAddrs};

/// Version of the metadata and wire protocol.
pub const PROTOCOL_VERSION: u32 = 2;

/// One region as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Name for messages.
    pub name: String,
    /// Bytes.
    pub len: u64,
    /// KV cache group.
    pub group: u32,
    /// Shared-memory segment backing it, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_name: Option<String>,
}

/// A producer's handshake metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerMetadata {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The producer's engine id.
    pub engine_id: String,
    /// Its control/data listener, `host:port`.
    pub listen: String,
    /// Its block shape.
    pub shape: BlockShape,
    /// Its layout.
    pub layout: KvLayout,
    /// Its regions' arrangement, in registration order.
    pub region_shapes: Vec<RegionShape>,
    /// Its regions' sizes and shm segments, same order.
    pub regions: Vec<RegionInfo>,
    /// Layers of each KV cache group.
    pub groups: Vec<Vec<LayerId>>,
    /// Its process id (for messages).
    pub pid: u32,
    /// Its NIXL agent, when it runs backend `nixl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl: Option<NixlAgentMetadata>,
    /// Its device regions' CUDA IPC handles, when it runs backend `cuda_ipc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_ipc: Option<CudaIpcMetadata>,
}

/// A producer's device regions as a same-host consumer opens them: one CUDA IPC handle
/// (128 hex digits) per region, same order as `regions`, and each region's device address
/// (used instead of the handle by a consumer in the same process, where CUDA refuses to open
/// its own handles).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaIpcMetadata {
    /// Device ordinal of the regions.
    pub device: i32,
    /// `cuIpcGetMemHandle` of each region, hex.
    pub handles: Vec<String>,
    /// Device address of each region in the producer's process.
    pub addrs: Vec<u64>,
    /// PCI bus id of that GPU: names it in the consumer's process whatever
    /// CUDA_VISIBLE_DEVICES numbers it there (absent from older producers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
}

/// A producer's NIXL agent as peers need it: name, `getLocalMD()` bytes (hex) and the base
/// address of each region (same order as `regions`) that READ descriptors are built from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlAgentMetadata {
    /// The agent's name.
    pub agent: String,
    /// Its metadata, hex.
    pub md: String,
    /// Base address of each registered region.
    pub region_addrs: Vec<u64>,
    /// The CUDA device ordinal (in the producer's process) when its regions are GPU memory
    /// registered as VRAM; absent when they are host memory (DRAM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vram_device: Option<u64>,
}

/// What a consumer knows of one producer.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// The producer's metadata, checked.
    pub meta: ProducerMetadata,
    /// Its listener.
    pub addr: SocketAddr,
    /// Its geometry.
    pub geometry: Geometry,
}

fn bad(msg: String) -> ConnectorError {
    ConnectorError::invalid(NAME, msg)
}

impl PeerInfo {
    /// Checks a producer's metadata on its own (sizes add up, address resolves).
    pub fn from_metadata(meta: ProducerMetadata) -> Result<PeerInfo, ConnectorError> {
        let e = &meta.engine_id;
        if meta.version != PROTOCOL_VERSION {
            return Err(bad(format!(
                "peer engine '{e}' speaks nixl protocol version {}, this build speaks {PROTOCOL_VERSION}: run the same kvconnect version on both sides",
                meta.version
            )));
        }
        if meta.regions.len() != meta.region_shapes.len() {
            return Err(bad(format!(
                "peer engine '{e}' metadata lists {} regions but {} region shapes",
                meta.regions.len(),
                meta.region_shapes.len()
            )));
        }
        let geometry = Geometry::new(meta.shape, meta.layout, meta.region_shapes.clone());
        for (r, s) in meta.regions.iter().zip(&meta.region_shapes) {
            let want = geometry.region_bytes(s) as u64;
            if r.len != want {
                return Err(bad(format!(
                    "peer engine '{e}' region '{}' is {} bytes but its geometry needs {want}",
                    r.name, r.len
                )));
            }
        }
        let addr = meta.listen.to_socket_addrs().ok().and_then(|mut a| a.next()).ok_or_else(|| {
            bad(format!("peer engine '{e}' listener address '{}' does not resolve", meta.listen))
        })?;
        Ok(PeerInfo { meta, addr, geometry })
    }

    /// Reads the host's handshake envelope (ARCHITECTURE.md §6) and checks the peer against this engine's geometry and
    /// the host's adaptation plan.
    pub fn from_envelope(
        env: &Value,
        own: &Geometry,
        own_groups: &[Vec<LayerId>],
    ) -> Result<PeerInfo, ConnectorError> {
        let engine_id = env
            .get("engine_id")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("peer handshake envelope has no string 'engine_id'".into()))?;
        let peer = env.get("peer").ok_or_else(|| {
            bad(format!("peer handshake envelope for '{engine_id}' has no 'peer' metadata"))
        })?;
        let meta: ProducerMetadata = serde_json::from_value(peer.clone()).map_err(|err| {
            bad(format!("peer engine '{engine_id}' sent nixl metadata that cannot be read: {err}"))
        })?;
        if meta.engine_id != engine_id {
            return Err(bad(format!(
                "peer handshake envelope names engine '{engine_id}' but its nixl metadata is from engine '{}'",
                meta.engine_id
            )));
        }
        let info = PeerInfo::from_metadata(meta)?;
        info.check_receivable(own, own_groups)?;
        if let Some(plan) = env.get("plan").filter(|p| !p.is_null()) {
            info.check_plan(plan, own)?;
        }
        Ok(info)
    }

    /// What this data path can adapt on receive: H/N/C order and tokens per block. Anything
    /// else (heads, head dim, dtype, K/V parts, groups) must be equal.
    pub fn check_receivable(
        &self,
        own: &Geometry,
        own_groups: &[Vec<LayerId>],
    ) -> Result<(), ConnectorError> {
        let (p, o) = (self.meta.shape, own.shape());
        let e = &self.meta.engine_id;
        for (field, a, b) in [
            ("kv heads", p.heads, o.heads),
            ("head dim", p.head_dim, o.head_dim),
            ("bytes per element", p.elem_size, o.elem_size),
            ("K/V parts", p.kv_parts, o.kv_parts),
        ] {
            if a != b {
                return Err(bad(format!(
                    "peer engine '{e}' has {a} {field} per block, this engine {b}: the KV caches are not compatible (same model and cache dtype on both sides are required)"
                )));
            }
        }
        if p.tokens == 0 || o.tokens == 0 {
            return Err(bad(format!("peer engine '{e}' or this engine has a block size of 0 tokens")));
        }
        if self.meta.groups != own_groups {
            return Err(bad(format!(
                "peer engine '{e}' has KV cache groups {:?}, this engine {:?}: both sides must use the same hybrid KV cache manager setting",
                self.meta.groups, own_groups
            )));
        }
        Ok(())
    }

    /// Checks the host's adaptation plan (`kvconnect_api::compat::AdaptationPlan`) against
    /// what this data path will do: the layout permutation and block-size ratio are applied
    /// on receive from the two geometries, so the plan must describe exactly those; a TP
    /// ratio other than 1:1 is not supported.
    fn check_plan(&self, plan: &Value, own: &Geometry) -> Result<(), ConnectorError> {
        let e = &self.meta.engine_id;
        let plan: AdaptationPlan = serde_json::from_value(plan.clone())
            .map_err(|err| bad(format!("adaptation plan for peer engine '{e}' cannot be read: {err}")))?;
        if let Some(l) = &plan.layout {
            if l.from != self.meta.layout || l.to != own.layout() {
                return Err(bad(format!(
                    "adaptation plan for peer engine '{e}' permutes {} -> {} but the peer's metadata says {} and this engine uses {}: the handshake and the regions disagree",
                    l.from,
                    l.to,
                    self.meta.layout,
                    own.layout()
                )));
            }
        }
        if let Some((r, s)) = plan.tp_ratio.filter(|(r, s)| r != s) {
            return Err(ConnectorError::not_implemented(
                NAME,
                &format!(
                    "receiving from peer engine '{e}' with tensor-parallel ratio {r}:{s} (heterogeneous TP)"
                ),
            ));
        }
        if let Some((r, s)) = plan.block_size_ratio {
            let (p, o) = (self.meta.shape.tokens as u64, own.shape().tokens as u64);
            // (receiver, sender): r / s == own / peer.
            if r as u64 * p != s as u64 * o {
                return Err(bad(format!(
                    "adaptation plan for peer engine '{e}' has block_size_ratio {r}:{s} (receiver:sender), but the peer's blocks hold {p} tokens and this engine's {o}"
                )));
            }
        }
        Ok(())
    }
}

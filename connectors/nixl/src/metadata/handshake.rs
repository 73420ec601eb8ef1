//! Handshake metadata: what a producer publishes (`handshake_metadata`) and what a consumer
//! keeps of it per peer engine (`set_peer_handshake_metadata`, the host's handshake envelope
//! `{"engine_id", "peer", "plan", "peer_effective"}`; ARCHITECTURE.md §6 and §7).

use crate::config::NAME;
use kvconnect_api::compat::AdaptationPlan;
use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::protocol::VersionMismatch;
use kvconnect_api::state_slots::StateSlots;
use kvconnect_api::{ConnectorError, KvLayout, LayerId};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::net::SocketAddr;

/// Version of the metadata and wire protocol.
pub const PROTOCOL_VERSION: u32 = 5;

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
    /// Its block shape (`heads`: one tensor-parallel rank's).
    pub shape: BlockShape,
    /// Its tensor-parallel ranks: `region_shapes` and `regions` list every rank's regions,
    /// rank by rank. Absent (1) from producers without TP.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub tp_size: u32,
    /// The one rank of `tp_size` whose regions these are, when the producer's ranks each
    /// serve their own (vLLM's workers); absent when the regions are every rank's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_rank: Option<u32>,
    /// Its opaque blocks hold the heads one after another (`Geometry::opaque_heads_outer`),
    /// so a consumer at another TP size can read a slice of heads.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque_heads_outer: bool,
    /// Its layout.
    pub layout: KvLayout,
    /// Its blocks are opaque (`EffectiveLayout::opaque_blocks`): they move whole, never
    /// adapted. Absent (false) from producers over known layouts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque_blocks: bool,
    /// Its regions' arrangement, in registration order.
    pub region_shapes: Vec<RegionShape>,
    /// Its regions' sizes and shm segments, same order.
    pub regions: Vec<RegionInfo>,
    /// Layers of each KV cache group, then of each state group.
    pub groups: Vec<Vec<LayerId>>,
    /// Its state regions (after the KV regions in `regions`) and their slot size; absent
    /// for models without state layers.
    #[serde(default, skip_serializing_if = "StateSlots::is_empty")]
    pub state: StateSlots,
    /// Its process id, for messages only: nothing a consumer decides or addresses depends
    /// on it.
    pub pid: u32,
    /// Its NIXL agent, when it runs backend `nixl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl: Option<NixlAgentMetadata>,
    /// Its device regions' CUDA IPC handles, when it runs backend `cuda_ipc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_ipc: Option<CudaIpcMetadata>,
}

/// A producer's device regions as a same-host consumer opens them: one CUDA IPC handle
/// (128 hex digits) per region, same order as `regions`. No device address: a consumer in
/// the producer's own process (where CUDA refuses to open the process's own handles) finds
/// the regions by handle among those its process exported (`crate::transport::cuda_ipc::exports`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaIpcMetadata {
    /// Device ordinal of the regions.
    pub device: i32,
    /// `cuIpcGetMemHandle` of each region, hex.
    pub handles: Vec<String>,
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

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// What names one producer to a consumer: its engine id and the side-channel address the
/// host handshook with it at (empty when the envelope named none). Two producers claiming
/// one engine id are two peers; everything a consumer keeps per producer (its metadata,
/// connections, mappings, NIXL agent) is kept by this.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerKey {
    /// The engine id it claims.
    pub engine: String,
    /// `host:port` of the side channel it was reached at.
    pub side_channel: String,
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.side_channel.is_empty() {
            write!(f, "'{}'", self.engine)
        } else {
            write!(f, "'{}' at {}", self.engine, self.side_channel)
        }
    }
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
    /// The side-channel address the host reached it at (the envelope's `side_channel`; empty
    /// when it names none).
    pub side_channel: String,
    /// Which handshake with it this is: a consumer numbers them, and state kept for an
    /// earlier one (connections to a producer that may have restarted) is not reused.
    pub generation: u64,
}

fn bad(msg: String) -> ConnectorError {
    ConnectorError::invalid(NAME, msg)
}

/// At most 64 characters of a peer's string, for messages.
fn truncated(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_owned(),
    }
}

impl PeerInfo {
    /// Checks a producer's metadata on its own: sizes add up (multiplied checked: they come
    /// from a peer) and the listener is an IP literal (nothing from the wire is resolved by
    /// DNS).
    pub fn from_metadata(meta: ProducerMetadata) -> Result<PeerInfo, ConnectorError> {
        let e = &meta.engine_id;
        VersionMismatch::check("nixl wire", "consumer", PROTOCOL_VERSION, "producer", Some(meta.version))
            .map_err(|m| bad(format!("peer engine '{e}': {m}")))?;
        let shapes = meta.region_shapes.len() + meta.state.regions.len();
        if meta.regions.len() != shapes {
            return Err(bad(format!(
                "peer engine '{e}' metadata lists {} regions but {} region shapes and {} state regions",
                meta.regions.len(),
                meta.region_shapes.len(),
                meta.state.regions.len()
            )));
        }
        if !meta.state.is_empty() && meta.state.first_region != meta.region_shapes.len() {
            return Err(bad(format!(
                "peer engine '{e}' metadata puts its state regions at {} but has {} KV regions before them",
                meta.state.first_region,
                meta.region_shapes.len()
            )));
        }
        for (r, s) in meta.regions[meta.region_shapes.len()..].iter().zip(&meta.state.regions) {
            if meta.state.region_bytes(s) != Some(r.len) {
                return Err(bad(format!(
                    "peer engine '{e}' state region '{}' is {} bytes but {} layer(s) x {} slots of {} bytes \
                        do not make that",
                    r.name,
                    r.len,
                    s.layers.len(),
                    s.num_slots,
                    meta.state.slot_bytes
                )));
            }
        }
        let split = || {
            bad(format!(
                "peer engine '{e}' metadata lists {} regions for tp_size {} (tp_rank {:?}): every \
                    tensor-parallel rank must list the same regions, and a single rank must be below tp_size",
                meta.region_shapes.len(),
                meta.tp_size,
                meta.tp_rank
            ))
        };
        let geometry = Geometry::new(meta.shape, meta.layout, meta.region_shapes.clone())
            .with_opaque_blocks(meta.opaque_blocks)
            .with_opaque_heads_outer(meta.opaque_heads_outer);
        let geometry = match meta.tp_rank {
            None => geometry.with_tp_ranks(meta.tp_size),
            Some(r) => geometry.as_rank_of(r, meta.tp_size),
        }
        .ok_or_else(split)?
        .with_state(meta.state.clone());
        if geometry.tp_size() > 1 && !geometry.state().is_empty() {
            return Err(bad(format!(
                "peer engine '{e}' has state layers at tp_size {}: not implemented: per-request state across \
                    tensor-parallel ranks (run a model with state layers at TP 1)",
                meta.tp_size
            )));
        }
        for (r, s) in meta.regions.iter().zip(&meta.region_shapes) {
            let want = geometry.checked_region_bytes(s).ok_or_else(|| {
                bad(format!(
                    "peer engine '{e}' region '{}' declares {} layers of {} blocks of {:?}, which overflows \
                        64 bits: the peer's metadata is corrupt or hostile",
                    r.name,
                    s.layers.len(),
                    s.num_blocks,
                    meta.shape
                ))
            })?;
            if r.len != want {
                return Err(bad(format!(
                    "peer engine '{e}' region '{}' is {} bytes but its geometry needs {want}",
                    r.name, r.len
                )));
            }
        }
        let addr: SocketAddr = meta.listen.parse().map_err(|_| {
            bad(format!(
                "peer engine '{e}' listener address '{}' is not an IP address and port (like 10.0.0.5:5601); \
                    host names from a peer are not resolved",
                truncated(&meta.listen)
            ))
        })?;
        Ok(PeerInfo { meta, addr, geometry, side_channel: String::new(), generation: 0 })
    }

    /// What names this peer.
    pub fn key(&self) -> PeerKey {
        PeerKey { engine: self.meta.engine_id.clone(), side_channel: self.side_channel.clone() }
    }

    /// Reads the host's handshake envelope (ARCHITECTURE.md §6) and checks the peer against this
    /// engine's geometry and the host's adaptation plan.
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
                "peer handshake envelope names engine '{engine_id}' but its \
                 nixl metadata is from engine '{}'",
                meta.engine_id
            )));
        }
        let mut info = PeerInfo::from_metadata(meta)?;
        info.side_channel = match env.get("side_channel") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => {
                return Err(bad(format!(
                    "peer handshake envelope for '{engine_id}' has side_channel {}: expected a \"host:port\" \
                        string",
                    truncated(&v.to_string())
                )))
            }
        };
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
            ("kv heads", self.geometry.total_heads(), own.total_heads()),
            ("head dim", p.head_dim, o.head_dim),
            ("bytes per element", p.elem_size, o.elem_size),
            ("K/V parts", p.kv_parts, o.kv_parts),
        ] {
            if a != b {
                return Err(bad(format!(
                    "peer engine '{e}' has {a} {field} per block, this engine {b}: the KV caches are not \
                        compatible (same model and cache dtype on both sides are required)"
                )));
            }
        }
        if p.tokens == 0 || o.tokens == 0 {
            return Err(bad(format!("peer engine '{e}' or this engine has a block size of 0 tokens")));
        }
        if self.meta.opaque_blocks != own.opaque_blocks() || (own.opaque_blocks() && p.tokens != o.tokens) {
            let side = |opaque: bool, tokens: u32| {
                format!("{} blocks of {tokens} tokens", if opaque { "opaque" } else { "known-layout" })
            };
            return Err(bad(format!(
                "peer engine '{e}' has {}, this engine {}: opaque blocks (an engine-private in-block order) \
                    move whole between engines with the same block size only, never adapted; run the same \
                    engine backend and block size on both sides",
                side(self.meta.opaque_blocks, p.tokens),
                side(own.opaque_blocks(), o.tokens)
            )));
        }
        let (ps, os) = (&self.meta.state, own.state());
        let layers = |s: &StateSlots| s.regions.iter().flat_map(|r| r.layers.clone()).collect::<Vec<_>>();
        if ps.slot_bytes != os.slot_bytes || layers(ps) != layers(os) {
            return Err(bad(format!(
                "peer engine '{e}' keeps per-request state of {} bytes in layers {:?}, this engine {} bytes \
                    in layers {:?}: the same model on both sides is required",
                ps.slot_bytes,
                layers(ps),
                os.slot_bytes,
                layers(os)
            )));
        }
        if self.meta.groups != own_groups {
            return Err(bad(format!(
                "peer engine '{e}' has KV cache groups {:?}, this engine {:?}: both sides must use the same \
                    hybrid KV cache manager setting",
                self.meta.groups, own_groups
            )));
        }
        Ok(())
    }

    /// Checks the host's adaptation plan (`kvconnect_api::compat::AdaptationPlan`) against
    /// what this data path will do: the layout permutation, block-size ratio and TP ratio
    /// are applied on receive from the two geometries, so the plan must describe exactly
    /// those.
    fn check_plan(&self, plan: &Value, own: &Geometry) -> Result<(), ConnectorError> {
        let e = &self.meta.engine_id;
        let plan: AdaptationPlan = serde_json::from_value(plan.clone())
            .map_err(|err| bad(format!("adaptation plan for peer engine '{e}' cannot be read: {err}")))?;
        if let Some(l) = &plan.layout {
            if l.from != self.meta.layout || l.to != own.layout() {
                return Err(bad(format!(
                    "adaptation plan for peer engine '{e}' permutes {} -> {} but the peer's metadata says {} \
                        and this engine uses {}: the handshake and the regions disagree",
                    l.from,
                    l.to,
                    self.meta.layout,
                    own.layout()
                )));
            }
        }
        if let Some((r, s)) = plan.tp_ratio {
            let (p, o) = (self.geometry.tp_size() as u64, own.tp_size() as u64);
            // (receiver, sender): r / s == own / peer.
            if r as u64 * p != s as u64 * o {
                return Err(bad(format!(
                    "adaptation plan for peer engine '{e}' has tp_ratio {r}:{s} (receiver:sender), but the \
                        peer's regions belong to {p} tensor-parallel rank(s) and this engine's to {o}"
                )));
            }
        }
        if let Some((r, s)) = plan.block_size_ratio {
            let (p, o) = (self.meta.shape.tokens as u64, own.shape().tokens as u64);
            // (receiver, sender): r / s == own / peer.
            if r as u64 * p != s as u64 * o {
                return Err(bad(format!(
                    "adaptation plan for peer engine '{e}' has block_size_ratio {r}:{s} (receiver:sender), \
                        but the peer's blocks hold {p} tokens and this engine's {o}"
                )));
            }
        }
        Ok(())
    }
}

/// A producer's metadata as tests need one: two layers of ten blocks in one region.
#[cfg(test)]
pub(crate) fn sample_metadata() -> ProducerMetadata {
    let shape = BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts: 2 };
    let region = RegionShape { layers: vec![LayerId(0), LayerId(1)], num_blocks: 10 };
    let len = Geometry::new(shape, KvLayout::NHD, vec![]).region_bytes(&region) as u64;
    ProducerMetadata {
        version: PROTOCOL_VERSION,
        engine_id: "prefill-0".into(),
        listen: "127.0.0.1:5601".into(),
        shape,
        layout: KvLayout::NHD,
        region_shapes: vec![region],
        regions: vec![RegionInfo { name: "kv".into(), len, group: 0, shm_name: None }],
        groups: vec![vec![LayerId(0), LayerId(1)]],
        state: StateSlots::default(),
        pid: 1,
        nixl: None,
        cuda_ipc: None,
        opaque_blocks: false,
        tp_size: 1,
        tp_rank: None,
        opaque_heads_outer: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ProducerMetadata {
        sample_metadata()
    }

    #[test]
    fn sane_metadata_is_read() {
        let info = PeerInfo::from_metadata(meta()).unwrap();
        assert_eq!(info.addr, "127.0.0.1:5601".parse().unwrap());
        let mut v6 = meta();
        v6.listen = "[::1]:5601".into();
        assert!(PeerInfo::from_metadata(v6).is_ok());
    }

    #[test]
    fn the_envelopes_side_channel_names_the_peer_with_its_engine() {
        let m = meta();
        let own = PeerInfo::from_metadata(m.clone()).unwrap().geometry;
        let env = |sc: Value| serde_json::json!({"engine_id": "prefill-0", "side_channel": sc, "peer": m});
        let info = PeerInfo::from_envelope(&env(Value::from("10.0.0.5:5600")), &own, &m.groups).unwrap();
        assert_eq!(info.key(), PeerKey { engine: "prefill-0".into(), side_channel: "10.0.0.5:5600".into() });
        assert_eq!(info.key().to_string(), "'prefill-0' at 10.0.0.5:5600");
        let info = PeerInfo::from_envelope(&env(Value::Null), &own, &m.groups).unwrap();
        assert_eq!(info.key().side_channel, "");
        let e = PeerInfo::from_envelope(&env(Value::from(5600)), &own, &m.groups).unwrap_err().to_string();
        assert!(e.contains("side_channel 5600: expected a \"host:port\" string"), "{e}");
    }

    #[test]
    fn sizes_that_overflow_are_refused_not_wrapped() {
        let mut m = meta();
        m.shape =
            BlockShape { heads: u32::MAX, tokens: u32::MAX, head_dim: u32::MAX, elem_size: 8, kv_parts: 2 };
        m.region_shapes[0].num_blocks = u32::MAX;
        // A length that a wrapping product could equal.
        m.regions[0].len = 0;
        let e = PeerInfo::from_metadata(m).unwrap_err().to_string();
        assert!(e.contains("overflows 64 bits") && e.contains("prefill-0"), "{e}");
    }

    #[test]
    fn host_names_are_refused_without_a_lookup() {
        for listen in ["localhost:5601", "prefill.example.com:5601", "127.0.0.1", "", &"x".repeat(10_000)] {
            let mut m = meta();
            m.listen = listen.to_owned();
            let e = PeerInfo::from_metadata(m).unwrap_err().to_string();
            assert!(e.contains("not an IP address and port") && e.len() < 400, "{listen}: {e}");
        }
    }

    #[test]
    fn a_producer_of_another_wire_version_is_refused_naming_both() {
        assert!(PeerInfo::from_metadata(meta()).is_ok());
        let mut m = meta();
        m.version = PROTOCOL_VERSION + 1;
        let e = PeerInfo::from_metadata(m).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "connector 'nixl': peer engine 'prefill-0': nixl wire version mismatch: this \
                 consumer speaks version {PROTOCOL_VERSION}, the producer speaks version {} — run \
                 the same kvconnect release on both",
                PROTOCOL_VERSION + 1
            )
        );
    }

    /// `meta()` with one state layer (2) of 10 slots of 64 bytes after its KV region.
    fn with_state() -> ProducerMetadata {
        use kvconnect_api::state_slots::StateRegion;
        let mut m = meta();
        m.state = StateSlots {
            slot_bytes: 64,
            first_region: 1,
            regions: vec![StateRegion { layers: vec![LayerId(2)], num_slots: 10 }],
        };
        m.regions.push(RegionInfo { name: "state.2".into(), len: 640, group: 1, shm_name: None });
        m.groups.push(vec![LayerId(2)]);
        m
    }

    #[test]
    fn state_regions_are_checked_and_must_match_this_engines() {
        use kvconnect_api::BlockId;
        let info = PeerInfo::from_metadata(with_state()).unwrap();
        assert_eq!(info.geometry.state().span(LayerId(2), BlockId(3)).unwrap().offset, 192);
        let mut short = with_state();
        short.regions[1].len = 639;
        let e = PeerInfo::from_metadata(short).unwrap_err().to_string();
        assert!(e.contains("state region 'state.2' is 639 bytes"), "{e}");
        let mut missing = with_state();
        missing.regions.pop();
        let e = PeerInfo::from_metadata(missing).unwrap_err().to_string();
        assert!(e.contains("1 region shapes and 1 state regions"), "{e}");
        // An engine without that state (another model) refuses the peer, naming both.
        let own = Geometry::new(info.meta.shape, info.meta.layout, info.meta.region_shapes.clone());
        let e = info.check_receivable(&own, &info.meta.groups).unwrap_err().to_string();
        assert!(
            e.contains("keeps per-request state of 64 bytes in layers [LayerId(2)], this engine 0 bytes"),
            "{e}"
        );
        let own = own.with_state(info.meta.state.clone());
        info.check_receivable(&own, &info.meta.groups).unwrap();
    }
}

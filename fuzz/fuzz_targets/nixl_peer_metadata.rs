//! The handshake envelope a decode worker gets for a producer: its nixl metadata (region
//! sizes, shapes, listener address) checked against this engine's geometry.
#![no_main]

use kvconnect_api::geometry::{BlockShape, Geometry, RegionShape};
use kvconnect_api::{KvLayout, LayerId};
use kvconnect_nixl::metadata::PeerInfo;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(env) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let shape = BlockShape { heads: 2, tokens: 4, head_dim: 8, elem_size: 2, kv_parts: 2 };
    let own = Geometry::new(
        shape,
        KvLayout::NHD,
        vec![RegionShape { layers: vec![LayerId(0), LayerId(1)], num_blocks: 10 }],
    );
    let _ = PeerInfo::from_envelope(&env, &own, &[vec![LayerId(0), LayerId(1)]]);
});

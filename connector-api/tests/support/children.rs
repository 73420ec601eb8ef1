//! Children declared like the built-in connectors, for the negotiation and compatibility
//! tests: the unit tests in `src/`, the integration tests and the benchmark include this one
//! file (`#[path]`), so a change to what the fixtures declare is made once.

#![allow(dead_code)]

use kvconnect_api::KvRole;
use kvconnect_api::{
    AdaptCost, Capabilities, ChildCaps, KvLayout, LayoutConstraint, MemoryKind, TransferMode,
};

/// A declaration in host and disk memory, for every role, with these choices and nothing
/// more.
pub fn caps(
    hma: bool,
    layout: LayoutConstraint,
    adapt: Option<AdaptCost>,
    mode: TransferMode,
) -> Capabilities {
    Capabilities::builder(mode, [MemoryKind::Host, MemoryKind::Disk], [KvRole::Both])
        .hma(hma)
        .layout(layout)
        .adapt(adapt)
        .build()
        .expect("the fixtures declare valid capabilities")
}

/// A child named `name`, version 0.1.0.
pub fn child(name: &str, caps: Capabilities) -> ChildCaps {
    ChildCaps { name: name.to_owned(), version: "0.1.0".to_owned(), caps }
}

/// Like connectors/lmcache: no HMA, NHD or HND, block size must divide the chunk size; MLA.
pub fn lmcache(chunk: u32) -> ChildCaps {
    let mut c = caps(
        false,
        LayoutConstraint {
            required: vec![KvLayout::NHD, KvLayout::HND],
            rejected: vec![],
            preferred: vec![KvLayout::NHD, KvLayout::HND],
        },
        None,
        TransferMode::None,
    );
    c.block_size_divides = Some(chunk);
    c.mla = true;
    child("lmcache", c)
}

/// Like connectors/nixl for a non-MLA model: HMA, requires HND, pulls, host memory.
pub fn nixl() -> ChildCaps {
    let mut c = caps(
        true,
        LayoutConstraint { required: vec![KvLayout::HND], rejected: vec![], preferred: vec![KvLayout::HND] },
        None,
        TransferMode::Pull,
    );
    c.memory_kinds = vec![MemoryKind::Host];
    child("nixl", c)
}

/// Like connectors/flexkv: no HMA, rejects HND, adapts at medium cost.
pub fn flexkv() -> ChildCaps {
    child(
        "flexkv",
        caps(
            false,
            LayoutConstraint {
                required: vec![],
                rejected: vec![KvLayout::HND],
                preferred: vec![KvLayout::NHD],
            },
            Some(AdaptCost::Medium),
            TransferMode::None,
        ),
    )
}

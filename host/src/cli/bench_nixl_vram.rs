//! `kvconnect bench nixl-vram`: NIXL over UCX with GPU memory on this machine — two agents in
//! this process, two device buffers registered as VRAM, one READ of `--blocks` shuffled
//! descriptors checked byte for byte, against one contiguous `cuMemcpyDtoD` of the same bytes
//! in the same run. Says what was found when the NIXL build cannot move GPU memory. Built
//! only with the `cuda` feature; the NIXL library is found as for backend nixl
//! (`NIXL_LIB_DIR`, or scripts/fetch-nixl.sh's `.nixl/`).

use anyhow::Result;

/// Arguments of `bench nixl-vram`.
#[derive(Debug, Clone, clap::Args)]
pub struct NixlVramArgs {
    /// Bytes per buffer (rounded down to a multiple of --blocks).
    #[arg(long, value_name = "N", default_value_t = 256 << 20)]
    pub bytes: usize,
    /// Descriptors of the READ (blocks spread over the buffer).
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub blocks: usize,
    /// Measured READs and copies (after one warm-up each); the best is reported.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub repeat: usize,
    /// GPU ordinal of both buffers.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: &NixlVramArgs) -> Result<()> {
    anyhow::bail!(
        "this kvconnect was built without GPU support: rebuild it with `cargo build --release -p \
            kvconnect-host --features cuda` to run bench nixl-vram"
    )
}

#[cfg(feature = "cuda")]
pub fn run(a: &NixlVramArgs) -> Result<()> {
    use kvconnect_bench::nixl_vram::{probe, VramProbe};
    let r = probe(VramProbe { gpu: a.gpu, bytes: a.bytes, blocks: a.blocks, repeat: a.repeat })
        .map_err(|e| anyhow::anyhow!("bench nixl-vram: {e}"))?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "NIXL READ of VRAM on GPU {} ({}): {} bytes in {} descriptors of {} bytes",
            r.gpu, r.device, r.bytes, r.blocks, r.block_bytes
        );
        println!(
            "  NIXL READ (UCX)       {:8.1} GB/s  {:8.3} ms  {:.2}x cuMemcpyDtoD",
            r.nixl_gbps, r.nixl_read_ms, r.ratio
        );
        println!("  contiguous DtoD copy  {:8.1} GB/s  {:8.3} ms", r.dtod_gbps, r.dtod_ms);
        println!("  first READ (set-up)   {:8.3} ms", r.first_read_ms);
        println!(
            "  bytes checked: {}; notifications received: {}; UCX memory types: {}; UCX CUDA module: {}",
            if r.verified { "all equal".to_owned() } else { format!("DIFFER at {:?}", r.first_mismatch) },
            r.notifications,
            r.backend_memory_types,
            r.ucx_cuda_module.as_deref().unwrap_or("(layout not the wheel's)")
        );
    }
    if !r.verified {
        anyhow::bail!(
            "NIXL READ of VRAM delivered wrong bytes (first difference at destination offset {:?})",
            r.first_mismatch
        );
    }
    Ok(())
}

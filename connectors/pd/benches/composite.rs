//! What the composite costs on the per-step path, each against the same work done without it,
//! measured in the same run as interleaved pairs (`kvconnect_support::stats::interleaved`: the
//! order alternates within a pair); the figure is the median ratio baseline time / composite
//! time with its quartiles, with the machine's cores and load average before and after. Both
//! sides run on one thread.
//! * `save_kv_layer`: every layer's save through a `PdWorker` over two children, against
//!   calling the two children directly; each run checks the blocks every child was given.
//! * step metadata envelope: building, encoding, decoding and splitting a step's envelope for
//!   two children, against cloning the children's bytes; each run checks the parts decoded.
//!
//! Run: `cargo bench -p kvconnect-pd --bench composite` (`PD_BENCH_PAIRS` sets the pairs, 21
//! by default). Without `--bench` (as `cargo test` runs it) each figure runs one pair of a
//! few steps.

use kvconnect_api::{
    BlockId, ConnectorResult, FinishedTransfers, KvRegion, LayerId, RequestId, WorkerConnector,
};
use kvconnect_pd::meta::{MetaEnvelope, MetaPart, META_VERSION};
use kvconnect_pd::PdWorker;
use kvconnect_support::stats::{bench_pairs, interleaved_timed, Machine};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The sizes of one run: the benchmark's, or the tiny one of a test run.
struct Size {
    pairs: usize,
    warmup: usize,
    /// Steps per timed run, on either side.
    steps: usize,
}

impl Size {
    fn from_args() -> Size {
        match bench_pairs("PD_BENCH_PAIRS", 21) {
            None => Size { pairs: 1, warmup: 0, steps: 2 },
            Some(pairs) => Size { pairs, warmup: 2, steps: 20_000 },
        }
    }
}

/// A child that only counts the blocks it is asked to save (an uncontended atomic: a
/// connector is `Send`).
struct Counting {
    blocks: Arc<AtomicU64>,
}

impl WorkerConnector for Counting {
    fn register_kv_caches(&mut self, _: &[KvRegion]) -> ConnectorResult<()> {
        Ok(())
    }
    fn bind_connector_meta(&mut self, _: &[u8]) -> ConnectorResult<()> {
        Ok(())
    }
    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        Ok(())
    }
    fn save_kv_layer(&mut self, _: LayerId, b: &[BlockId]) -> ConnectorResult<()> {
        self.blocks.fetch_add(black_box(b.len()) as u64, Relaxed);
        Ok(())
    }
    fn get_finished(&mut self, _: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        Ok(FinishedTransfers::default())
    }
}

const LAYERS: u32 = 32;
const BLOCKS: u32 = 64;

/// A step's saves (every layer) by `save`, and a check that each of the two children was given
/// every layer's blocks once.
fn saves(steps: usize, counts: &[Arc<AtomicU64>; 2], what: &str, mut save: impl FnMut(LayerId)) {
    let before = counts.each_ref().map(|c| c.load(Relaxed));
    for _ in 0..steps {
        for l in 0..LAYERS {
            save(LayerId(l));
        }
    }
    let want = steps as u64 * u64::from(LAYERS * BLOCKS);
    for (i, c) in counts.iter().enumerate() {
        assert_eq!(c.load(Relaxed) - before[i], want, "{what}: child {i} was not given every layer's blocks");
    }
}

fn save_fanout(size: &Size) {
    let blocks: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
    let counting = |c: &Arc<AtomicU64>| Box::new(Counting { blocks: c.clone() }) as Box<dyn WorkerConnector>;
    let direct_counts = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
    let mut direct: Vec<Box<dyn WorkerConnector>> = direct_counts.iter().map(counting).collect();
    let pd_counts = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
    let mut pd: Box<dyn WorkerConnector> = Box::new(PdWorker::new(vec![
        ("a".into(), counting(&pd_counts[0])),
        ("b".into(), counting(&pd_counts[1])),
    ]));
    let steps = size.steps;
    let m = Machine::start();
    let p = interleaved_timed(
        size.pairs,
        size.warmup,
        || {
            saves(steps, &direct_counts, "direct", |l| {
                for child in direct.iter_mut() {
                    child.save_kv_layer(l, black_box(&blocks)).expect("a child's save_kv_layer");
                }
            })
        },
        || {
            saves(steps, &pd_counts, "composite", |l| {
                pd.save_kv_layer(l, black_box(&blocks)).expect("the composite's save_kv_layer")
            })
        },
    );
    println!(
        "RATIO save_kv_layer x {LAYERS} layers, {BLOCKS} blocks, 2 no-op children: composite vs \
         the children called directly: {}; {}",
        p.summary_per(steps, "step"),
        m.finish()
    );
}

fn meta_envelope(size: &Size) {
    // Two children's metadata for a step: a few KiB each (block ids and hashes of a batch).
    let parts: Vec<Vec<u8>> = (0..2).map(|i| (0..4096u32).map(|x| (x * 7 + i) as u8).collect()).collect();
    let names = vec!["lmcache".to_owned(), "nixl".to_owned()];
    let steps = (size.steps / 10).max(1);
    let m = Machine::start();
    let p = interleaved_timed(
        size.pairs,
        size.warmup,
        || {
            for _ in 0..steps {
                let copies: Vec<Vec<u8>> = black_box(&parts).clone();
                assert!(copies == parts, "the cloned bytes differ");
            }
        },
        || {
            for _ in 0..steps {
                let env = MetaEnvelope {
                    version: META_VERSION,
                    parts: parts
                        .iter()
                        .zip(&names)
                        .enumerate()
                        .map(|(index, (p, n))| MetaPart { index, name: n.clone(), bytes: p.clone() })
                        .collect(),
                    delayed: BTreeMap::new(),
                    loads: BTreeMap::new(),
                };
                let bytes = env.encode();
                let back = MetaEnvelope::decode(black_box(&bytes), &names).expect("decode the envelope");
                assert!(
                    back.parts.iter().map(|p| &p.bytes).eq(parts.iter()),
                    "the envelope gave back other parts"
                );
            }
        },
    );
    println!(
        "RATIO step metadata envelope, 2 children x 4 KiB: \
         build + encode + decode + split vs cloning the bytes: {}; {}",
        p.summary_per(steps, "step"),
        m.finish()
    );
}

fn main() {
    let size = Size::from_args();
    let all = Machine::start();
    println!("pd composite bench ({} pairs per ratio): {all}", size.pairs);
    save_fanout(&size);
    meta_envelope(&size);
    println!("pd composite bench done: {}", all.finish());
}

//! What the composite costs on the per-step path, as ratios against the same work done
//! without it in the same run:
//! * `save_fanout`: `save_kv_layer` for every layer through a `PdWorker` over two children,
//!   against calling the two children directly.
//! * `meta_envelope`: building and splitting a step's metadata envelope for two children,
//!   against copying the children's bytes.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kvconnect_api::{
    BlockId, ConnectorResult, FinishedTransfers, KvRegion, LayerId, RequestId, WorkerConnector,
};
use kvconnect_pd::meta::{MetaEnvelope, MetaPart, META_VERSION};
use kvconnect_pd::PdWorker;
use std::collections::BTreeMap;

/// A child that only counts what it is asked to save.
#[derive(Default)]
struct Counting {
    blocks: u64,
}

impl WorkerConnector for Counting {
    fn register_kv_caches(&mut self, _: &[KvRegion]) -> ConnectorResult<()> {
        Ok(())
    }
    fn bind_connector_meta(&mut self, m: &[u8]) -> ConnectorResult<()> {
        self.blocks += m.len() as u64;
        Ok(())
    }
    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        Ok(())
    }
    fn save_kv_layer(&mut self, _: LayerId, b: &[BlockId]) -> ConnectorResult<()> {
        self.blocks += black_box(b.len()) as u64;
        Ok(())
    }
    fn get_finished(&mut self, _: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        Ok(FinishedTransfers::default())
    }
}

const LAYERS: u32 = 32;

fn save_fanout(c: &mut Criterion) {
    let blocks: Vec<BlockId> = (0..64).map(BlockId).collect();
    let mut g = c.benchmark_group("save_fanout");
    let mut direct: Vec<Box<dyn WorkerConnector>> =
        vec![Box::new(Counting::default()), Box::new(Counting::default())];
    g.bench_function("direct_2_children", |b| {
        b.iter(|| {
            for l in 0..LAYERS {
                for child in direct.iter_mut() {
                    child.save_kv_layer(LayerId(l), black_box(&blocks)).unwrap();
                }
            }
        })
    });
    let mut pd: Box<dyn WorkerConnector> = Box::new(PdWorker::new(vec![
        ("a".into(), Box::new(Counting::default()) as Box<dyn WorkerConnector>),
        ("b".into(), Box::new(Counting::default())),
    ]));
    g.bench_function("composite_2_children", |b| {
        b.iter(|| {
            for l in 0..LAYERS {
                pd.save_kv_layer(LayerId(l), black_box(&blocks)).unwrap();
            }
        })
    });
    g.finish();
}

fn meta_envelope(c: &mut Criterion) {
    // Two children's metadata for a step: a few KiB each (block ids and hashes of a batch).
    let parts: Vec<Vec<u8>> = (0..2).map(|i| (0..4096u32).map(|x| (x * 7 + i) as u8).collect()).collect();
    let names = vec!["lmcache".to_owned(), "nixl".to_owned()];
    let mut g = c.benchmark_group("meta_envelope");
    g.bench_function("copy_bytes", |b| {
        b.iter(|| {
            let copies: Vec<Vec<u8>> = black_box(&parts).clone();
            black_box(copies)
        })
    });
    g.bench_function("encode_decode", |b| {
        b.iter(|| {
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
            black_box(MetaEnvelope::decode(&bytes, &names).unwrap())
        })
    });
    g.finish();
}

criterion_group!(benches, save_fanout, meta_envelope);
criterion_main!(benches);

//! In-process pull of the Qwen3-0.6B KV geometry (28 layers, 8 KV heads, head dim 128, bf16,
//! block 16, HND: 112 KiB per token) from a producer connector into consumer regions through
//! `Puller::pull` (hold, copy, done round trips included), over shm and over tcp, each
//! against a baseline measured in the same run as interleaved pairs
//! (`kvconnect_support::stats::interleaved`: the order alternates within a pair); the figure is
//! the median ratio baseline time / pull time with its quartiles, with the machine's cores
//! and load average before and after.
//!
//! * shm against the fastest memcpy of the same bytes, heap to heap (`kvconnect_bench::memcpy`:
//!   glibc's copy and the streaming-store copy the pull uses, each on one thread and on the
//!   pull's copy threads; each pair times every way, and the way with the lowest median is
//!   the baseline, `interleaved_fastest`), its destination scrambled before each copy and
//!   checked after, as the pull's is;
//! * tcp against a raw loopback socket streaming the same bytes over as many streams, with
//!   the same socket buffers (`kvconnect_bench::raw_socket`).
//!
//! Before each pull the consumer's regions are scrambled and after it every byte is checked
//! against the producer's (neither is timed).
//!
//! Run: `cargo bench -p kvconnect-nixl --bench pull`. `NIXL_BENCH_TOKENS` sets the tokens
//! (1024 = 112 MiB per transfer by default; 8192 is the full 896 MiB prompt),
//! `NIXL_BENCH_PAIRS` the pairs (21). Without `--bench` (as `cargo test` runs it) each
//! figure runs one pair of a 3-block pull.

use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, KvLayout, KvRole, RequestId, WorkerConnector,
};
use kvconnect_bench::harness::{context, effective, model, Regions};
use kvconnect_bench::memcpy::{memcpy_ways, timed_copy};
use kvconnect_bench::raw_socket::{RawSocket, SENT};
use kvconnect_nixl::copy_plan::default_copy_threads;
use kvconnect_nixl::metadata::{LoadSpec, NixlMeta, SendSpec};
use kvconnect_nixl::tcp_data::{default_tcp_streams, streams_for, DEFAULT_SOCKET_BUFFER, STREAM_MIN_BYTES};
use kvconnect_nixl::transport::{shm::Shm, tcp::Tcp, Transport};
use kvconnect_nixl::{NixlFactory, PeerInfo, ProducerMetadata, PullConfig, Puller};
use kvconnect_support::host_buffer::HostBuffer;
use kvconnect_support::stats::{bench_pairs, interleaved, interleaved_fastest, Machine, Paired};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;

/// The sizes of one run: the benchmark's, or the tiny one of a test run.
struct Size {
    pairs: usize,
    warmup: usize,
    tokens: usize,
}

impl Size {
    fn from_args() -> Size {
        match bench_pairs("NIXL_BENCH_PAIRS", 21) {
            None => Size { pairs: 1, warmup: 0, tokens: 3 * BLOCK as usize },
            Some(pairs) => {
                let tokens = std::env::var("NIXL_BENCH_TOKENS").ok().and_then(|v| v.parse().ok());
                Size { pairs, warmup: 2, tokens: tokens.unwrap_or(1024) }
            }
        }
    }
}

fn report(name: &str, p: &Paired, bytes: usize, m: Machine) {
    println!("RATIO {name}: {}; goal >= 0.9: {}; {m}", p.summary(Some(bytes)), p.verdict(0.9));
}

/// A producer connector over shm regions holding a pattern, and consumer regions (heap) of
/// the same blocks, with the load that pulls all of them.
struct Pull {
    producer: Box<dyn WorkerConnector>,
    pmem: Regions,
    dmem: Regions,
    local: KvMemory,
    peer: PeerInfo,
    groups: Vec<Vec<kvconnect_api::LayerId>>,
    load: LoadSpec,
    bytes: usize,
}

impl Pull {
    fn new(tokens: usize) -> Pull {
        let nblocks = (tokens as u32).div_ceil(BLOCK);
        let m = model(28, 8, 128);
        let eff = effective(&m, KvLayout::HND, BLOCK);
        let prefix = format!("/kvc-nixl-bench-{}", std::process::id());
        let mut pmem = Regions::allocate(&m, &eff, nblocks, Some(&prefix)).unwrap_or_else(|e| {
            panic!("shm regions under {prefix} (is /dev/shm writable and large enough?): {e}")
        });
        // A pattern that differs from byte to byte and region to region, so a block copied to
        // the wrong place is seen.
        for i in 0..pmem.regions().len() {
            for (j, b) in pmem.bytes_mut(i).iter_mut().enumerate() {
                *b = ((j as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ i as u8;
            }
        }
        let pctx = context(
            &m,
            &eff,
            KvRole::Producer,
            "prefill-bench",
            // tcp serves reads; an shm consumer only checks and maps.
            json!({"backend": "tcp", "kv_lease_duration": 600, "kv_lease_max": 3600}),
        );
        let mut producer = NixlFactory.create_worker(&pctx).expect("create the producer worker");
        producer.register_kv_caches(pmem.regions()).expect("register the producer's regions");
        let meta: ProducerMetadata = serde_json::from_value(
            producer.handshake_metadata().expect("producer metadata").expect("the producer has metadata"),
        )
        .expect("the producer's metadata parses");
        let peer = PeerInfo::from_metadata(meta).expect("peer from the producer's metadata");
        let dmem = Regions::allocate(&m, &eff, nblocks, None).expect("consumer regions");
        let local = KvMemory::new(dmem.regions(), &m, &eff).expect("consumer memory");
        let ids: Vec<BlockId> = (0..nblocks).map(BlockId).collect();
        let load = LoadSpec {
            request: RequestId::from("bench"),
            remote_request: None,
            remote_engine_id: "prefill-bench".into(),
            remote_capability: "bench-capability".into(),
            remote_side_channel: String::new(),
            remote_blocks: BlocksPerGroup(vec![ids.clone()]),
            local_blocks: BlocksPerGroup(vec![ids]),
            first_token: 0,
            num_tokens: tokens,
            reader: None,
            sources: 1,
            sync: false,
        };
        let bytes = pmem.regions().iter().map(|r| r.len() as usize).sum();
        Pull { producer, pmem, dmem, local, peer, groups: vec![m.kv_layers()], load, bytes }
    }

    /// The producer holds the load's blocks for the next pull.
    fn hold(&mut self) {
        let meta = NixlMeta {
            loads: vec![],
            sends: vec![SendSpec {
                request: "bench".into(),
                capability: "bench-capability".into(),
                blocks: self.load.remote_blocks.clone(),
            }],
        };
        let meta = serde_json::to_vec(&meta).expect("send metadata to JSON");
        self.producer.bind_connector_meta(&meta).expect("the producer holds the blocks");
        let _ = self.producer.get_finished(&[]);
    }

    /// One pull through `puller`, timed alone: hold, scramble and check around it are not.
    fn pull(&mut self, puller: &mut Puller, what: &str) -> Result<f64, String> {
        self.hold();
        for i in 0..self.dmem.regions().len() {
            self.dmem.bytes_mut(i).fill(0xa5);
        }
        let t = Instant::now();
        puller
            .pull(&self.local, &self.groups, &self.peer, &self.load)
            .map_err(|e| format!("{what} pull: {e}"))?;
        let took = t.elapsed().as_secs_f64();
        for i in 0..self.pmem.regions().len() {
            if self.dmem.bytes_mut(i) != self.pmem.bytes_mut(i) {
                return Err(format!("{what} pull: region {i} does not hold the producer's bytes"));
            }
        }
        Ok(took)
    }
}

fn puller(transport: Arc<dyn Transport>) -> Puller {
    Puller::new(
        PullConfig {
            io_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            max_frame: 16 << 20,
            socket_buffer: DEFAULT_SOCKET_BUFFER,
            secret: None,
        },
        transport,
    )
}

fn shm(size: &Size, pull: &mut Pull) -> Result<(), String> {
    let threads = default_copy_threads();
    let mut puller = puller(Arc::new(Shm::new(threads)));
    // Allocated as the consumer's KV regions are (huge pages where the kernel gives them).
    let (mut src, mut dst) = match (HostBuffer::zeroed(pull.bytes), HostBuffer::zeroed(pull.bytes)) {
        (Ok(s), Ok(d)) => (s, d),
        (Err(e), _) | (_, Err(e)) => return Err(format!("memcpy baseline buffers: {e}")),
    };
    for (i, b) in src.bytes_mut().iter_mut().enumerate() {
        *b = (i as u8) ^ 0x5a;
    }
    dst.bytes_mut().copy_from_slice(src.bytes()); // fault every page in before timing
    let ways = memcpy_ways(pull.bytes, threads);
    let m = Machine::start();
    let (p, fastest) = interleaved_fastest(
        size.pairs,
        size.warmup,
        || {
            // Each way meets what the pull meets: a scrambled destination, checked after.
            let mut times = Vec::with_capacity(ways.len());
            for w in &ways {
                dst.bytes_mut().fill(0xa5);
                times.push(timed_copy(dst.bytes_mut(), src.bytes(), w.copier, w.threads).as_secs_f64());
                if dst.bytes() != src.bytes() {
                    return Err(format!("the memcpy baseline ({w}) copied other bytes"));
                }
            }
            Ok(times)
        },
        || pull.pull(&mut puller, "shm"),
    )?;
    report(
        &format!("shm pull vs the fastest memcpy ({}; {threads} copy threads)", ways[fastest]),
        &p,
        pull.bytes,
        m.finish(),
    );
    Ok(())
}

fn tcp(size: &Size, pull: &mut Pull) -> Result<(), String> {
    let streams = streams_for(pull.bytes as u64, default_tcp_streams(), STREAM_MIN_BYTES);
    let mut puller = puller(Arc::new(Tcp::new(default_tcp_streams(), STREAM_MIN_BYTES)));
    let rounds = size.warmup + size.pairs.max(1);
    let mut raw = RawSocket::start(pull.bytes, rounds, streams, DEFAULT_SOCKET_BUFFER)
        .map_err(|e| format!("raw-socket baseline: listening on 127.0.0.1: {e}"))?;
    let m = Machine::start();
    let p = interleaved(
        size.pairs,
        size.warmup,
        || {
            let t = raw.measure().map_err(|e| format!("raw-socket baseline: {e}"))?.as_secs_f64();
            if raw.received().iter().any(|b| *b != SENT) {
                return Err("the raw-socket baseline received other bytes".to_owned());
            }
            Ok(t)
        },
        || pull.pull(&mut puller, "tcp"),
    )?;
    raw.finish().map_err(|e| format!("raw-socket baseline sender: {e}"))?;
    report(
        &format!(
            "tcp pull vs raw socket ({streams} stream{}, {} MiB socket buffers)",
            if streams == 1 { "" } else { "s" },
            DEFAULT_SOCKET_BUFFER >> 20
        ),
        &p,
        pull.bytes,
        m.finish(),
    );
    Ok(())
}

fn main() {
    let size = Size::from_args();
    let all = Machine::start();
    let mut pull = Pull::new(size.tokens);
    println!(
        "nixl pull bench ({} tokens = {} bytes per transfer; {} pairs per ratio): {all}",
        size.tokens, pull.bytes, size.pairs
    );
    if let Err(e) = shm(&size, &mut pull).and_then(|()| tcp(&size, &mut pull)) {
        eprintln!("nixl pull bench failed: {e}");
        std::process::exit(1);
    }
    println!("nixl pull bench done: {}", all.finish());
}

//! In-process pull of the Qwen3-0.6B KV geometry (28 layers, 8 KV heads, head dim 128, bf16,
//! block 16: 112 KiB per token) over shm and tcp, against a memcpy of the same bytes and a
//! raw loopback TCP socket streaming the same bytes, measured in the same run.
//!
//! Tokens default to 1024 (112 MiB per transfer) to keep criterion runs short;
//! `NIXL_BENCH_TOKENS=8192` gives the full 896 MiB prompt.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorFactory, KvLayout, KvRole, RequestId, WorkerConnector,
};
use kvconnect_bench::harness::{context, effective, model, Regions};
use kvconnect_nixl::metadata::{LoadSpec, NixlMeta, SendSpec};
use kvconnect_nixl::shm::ShmMapping;
use kvconnect_nixl::stream_copy::copy_run;
use kvconnect_nixl::transport::{shm::Shm, tcp::Tcp, Transport};
use kvconnect_nixl::{NixlFactory, PeerInfo, ProducerMetadata, PullConfig, Puller};
use serde_json::json;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

const BLOCK: u32 = 16;

fn tokens() -> usize {
    std::env::var("NIXL_BENCH_TOKENS").ok().and_then(|s| s.parse().ok()).unwrap_or(1024)
}

fn bench(c: &mut Criterion) {
    let n = tokens();
    let nblocks = (n as u32).div_ceil(BLOCK);
    let m = model(28, 8, 128);
    let eff = effective(&m, KvLayout::HND, BLOCK);
    let layers = m.kv_layers();
    let bytes = n as u64 * 28 * 2 * 8 * 128 * 2;

    // Producer: shm regions (readable by tcp too), blocks 0..nblocks.
    let prefix = format!("/kvc-nixl-bench-{}", std::process::id());
    let pmem = Regions::allocate(&m, &eff, nblocks, Some(&prefix)).expect("shm regions");
    let pctx = context(
        &m,
        &eff,
        KvRole::Producer,
        "prefill-bench",
        // tcp serves reads; an shm consumer only checks and maps.
        json!({"backend": "tcp", "kv_lease_duration": 600, "kv_lease_max": 3600}),
    );
    let mut producer = NixlFactory.create_worker(&pctx).expect("producer");
    producer.register_kv_caches(pmem.regions()).expect("register producer");
    let meta: ProducerMetadata =
        serde_json::from_value(producer.handshake_metadata().expect("meta").expect("producer meta"))
            .expect("meta json");
    let peer = PeerInfo::from_metadata(meta).expect("peer");

    // Consumer: heap regions, same block ids.
    let dmem = Regions::allocate(&m, &eff, nblocks, None).expect("regions");
    let local = KvMemory::new(dmem.regions(), &m, &eff).expect("consumer memory");
    let ids: Vec<BlockId> = (0..nblocks).map(BlockId).collect();
    let groups = vec![layers.clone()];
    let load = LoadSpec {
        request: RequestId::from("bench"),
        remote_request: None,
        remote_engine_id: "prefill-bench".into(),
        remote_capability: "bench-capability".into(),
        remote_side_channel: String::new(),
        remote_blocks: BlocksPerGroup(vec![ids.clone()]),
        local_blocks: BlocksPerGroup(vec![ids.clone()]),
        first_token: 0,
        num_tokens: n,
    };
    let hold = |w: &mut Box<dyn WorkerConnector>| {
        let meta = NixlMeta {
            loads: vec![],
            sends: vec![SendSpec {
                request: "bench".into(),
                capability: "bench-capability".into(),
                blocks: BlocksPerGroup(vec![ids.clone()]),
            }],
        };
        w.bind_connector_meta(&serde_json::to_vec(&meta).expect("meta")).expect("hold");
        let _ = w.get_finished(&[]);
    };

    let mut g = c.benchmark_group(format!("nixl_pull_{n}tok"));
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(10);

    let src = vec![1u8; bytes as usize];
    let mut dst = vec![0u8; bytes as usize];
    g.bench_function("memcpy_heap", |b| b.iter(|| dst.copy_from_slice(std::hint::black_box(&src))));

    // The same bytes in per-region chunks, as the pull copies them.
    let chunk = bytes as usize / pmem.regions().len();
    g.bench_function("memcpy_heap_per_region", |b| {
        b.iter(|| {
            for (d, s) in dst.chunks_mut(chunk).zip(std::hint::black_box(&src).chunks(chunk)) {
                d.copy_from_slice(s);
            }
        })
    });

    // The same copy without the protocol: each producer segment, mapped read-only as the
    // shm backend maps it, memcpy'd whole into the consumer's region (the runs cover whole
    // regions here). Separates the connector's overhead from shared memory's page costs.
    let maps: Vec<ShmMapping> = pmem
        .regions()
        .iter()
        .map(|r| ShmMapping::open(r.shm_name().expect("shm name"), r.len()).expect("map"))
        .collect();
    let mut dmem = dmem;
    g.bench_function("memcpy_from_shm", |b| {
        b.iter(|| {
            for (i, m) in maps.iter().enumerate() {
                dmem.bytes_mut(i).copy_from_slice(std::hint::black_box(m.as_slice()));
            }
        })
    });

    g.bench_function("stream_copy_from_shm", |b| {
        b.iter(|| {
            for (i, m) in maps.iter().enumerate() {
                copy_run(dmem.bytes_mut(i), std::hint::black_box(m.as_slice()));
            }
        })
    });

    let backends: [Arc<dyn Transport>; 2] = [
        Arc::new(Shm::new(kvconnect_nixl::copy_plan::default_copy_threads())),
        Arc::new(Tcp::new(
            kvconnect_nixl::tcp_data::default_tcp_streams(),
            kvconnect_nixl::tcp_data::STREAM_MIN_BYTES,
        )),
    ];
    for transport in backends {
        let backend = transport.backend();
        let mut puller = Puller::new(
            PullConfig {
                io_timeout: Duration::from_secs(30),
                connect_timeout: Duration::from_secs(5),
                max_frame: 16 << 20,
                socket_buffer: kvconnect_nixl::tcp_data::DEFAULT_SOCKET_BUFFER,
                secret: None,
            },
            transport,
        );
        g.bench_function(format!("{}_pull", backend.name()), |b| {
            b.iter_batched(
                || hold(&mut producer),
                |_| puller.pull(&local, &groups, &peer, &load).expect("pull"),
                BatchSize::PerIteration,
            )
        });
    }

    // Raw loopback socket: one request byte, then the same number of bytes streamed into a
    // buffer of the same size.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let total = bytes as usize;
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let data = vec![2u8; total];
        let mut req = [0u8; 1];
        while s.read_exact(&mut req).is_ok() {
            if s.write_all(&data).is_err() {
                break;
            }
        }
    });
    let mut sock = TcpStream::connect(addr).expect("connect");
    sock.set_nodelay(true).expect("nodelay");
    g.bench_function("raw_tcp", |b| {
        b.iter(|| {
            sock.write_all(&[1]).expect("request");
            sock.read_exact(&mut dst).expect("stream");
        })
    });
    drop(sock);
    let _ = server.join();
    g.finish();
    drop(producer);
}

criterion_group!(benches, bench);
criterion_main!(benches);

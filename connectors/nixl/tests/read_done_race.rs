//! A read racing a done, or a lease expiry, never ships freed bytes: a producer listener
//! serves reads of requests whose holds end (by a consumer's done on another connection, or
//! by a short lease) while the "host" frees their blocks and at once refills them for the next
//! request. Every block carries its request's tag, so a read that returned any byte of a
//! block after it was reused shows as a block whose bytes are not its request's.

use kvconnect_api::geometry::Span;
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{BlockId, BlocksPerGroup, KvLayout, LayerId, RequestId};
use kvconnect_bench::harness::{effective, model, Regions};
use kvconnect_dataplane::auth::Secret;
use kvconnect_nixl::producer::{Producer, ProducerConfig};
use kvconnect_nixl::wire::{authenticate_client, read_frame, write_frame, ClientMsg, ServerMsg};
use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECRET: &str = "read-done-race-deployment-secret-0123456789";
const BLOCKS: u32 = 12;
const PER_REQUEST: usize = 3;
const READERS: usize = 4;

/// A request the host holds: its id, capability, blocks and the tag its blocks carry.
#[derive(Clone)]
struct Live {
    id: String,
    capability: String,
    blocks: Vec<BlockId>,
    tag: u64,
}

/// The bytes block `b` of the request tagged `tag` holds: a tag-and-block word, repeated.
fn word(tag: u64, b: BlockId) -> [u8; 8] {
    (tag << 16 | u64::from(b.0)).to_le_bytes()
}

/// Every span of `blocks` over all layers and K/V parts.
fn spans(mem: &KvMemory, layers: &[LayerId], blocks: &[BlockId]) -> Vec<(BlockId, Span)> {
    let g = mem.geometry();
    let mut out = Vec::new();
    for &b in blocks {
        for &l in layers {
            for part in 0..g.shape().kv_parts {
                out.push((b, g.span(l, part, b).expect("span of a block in range")));
            }
        }
    }
    out
}

/// Small, fast and deterministic (xorshift64).
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn connect(addr: std::net::SocketAddr, secret: &Secret) -> TcpStream {
    let mut c = TcpStream::connect(addr).expect("connect to the producer");
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    authenticate_client(&mut c, Some(secret), 1 << 20).expect("authenticate");
    c
}

#[test]
fn reads_racing_done_and_lease_expiry_never_ship_bytes_of_a_reused_block() {
    let m = model(2, 2, 8);
    let eff = effective(&m, KvLayout::HND, 4);
    let mut regions = Regions::allocate(&m, &eff, BLOCKS, None).unwrap();
    let mem = Arc::new(KvMemory::new(regions.regions(), &m, &eff).unwrap());
    let layers = m.kv_layers();
    let groups = vec![layers.clone()];
    let secret = Secret::from_text(SECRET, "test").unwrap();
    let producer = Producer::start(
        mem.clone(),
        ProducerConfig {
            engine_id: "prefill-race".into(),
            host: "127.0.0.1".into(),
            port: 0,
            // Short leases, so expiry races reads as often as done does.
            lease: Duration::from_millis(30),
            io_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            max_frame: 1 << 20,
            unknown_grace: Duration::ZERO,
            secret: Some(secret.clone()),
            lease_max: Duration::from_millis(120),
            max_connections: 16,
            socket_buffer: 0,
            serve_reads: true,
        },
    )
    .unwrap();
    let addr = producer.addr();
    let live: Arc<Mutex<Vec<Live>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let (good_reads, refused_reads, dones) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let mismatches: Mutex<Vec<String>> = Mutex::default();

    std::thread::scope(|s| {
        for r in 0..READERS {
            let (live, stop, mem, layers, secret) = (&live, &stop, &mem, &layers, &secret);
            let (good_reads, refused_reads, dones, mismatches) =
                (&good_reads, &refused_reads, &dones, &mismatches);
            s.spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (r as u64 + 1));
                let mut c = connect(addr, secret);
                while !stop.load(Ordering::Relaxed) {
                    let Some(req) = ({
                        let l = live.lock().unwrap();
                        (!l.is_empty()).then(|| l[rng.below(l.len())].clone())
                    }) else {
                        std::thread::yield_now();
                        continue;
                    };
                    // One in four asks: this reader is done with it, racing the others' reads.
                    if rng.below(4) == 0 {
                        let done =
                            ClientMsg::Done { request: req.id.clone(), capability: req.capability.clone() };
                        write_frame(&mut c, &done).unwrap();
                        let answer: ServerMsg = read_frame(&mut c, 1 << 20).unwrap();
                        if matches!(answer, ServerMsg::Ok) {
                            dones.fetch_add(1, Ordering::Relaxed);
                        }
                        continue;
                    }
                    let spans = spans(mem, layers, &req.blocks);
                    let runs = spans
                        .iter()
                        .map(|(_, sp)| (sp.region as u32, sp.offset as u64, sp.len as u64))
                        .collect();
                    let read =
                        ClientMsg::Read { request: req.id.clone(), capability: req.capability.clone(), runs };
                    write_frame(&mut c, &read).unwrap();
                    match read_frame::<_, ServerMsg>(&mut c, 1 << 20).unwrap() {
                        ServerMsg::Data { .. } => {
                            // Read the whole answer before judging it, so the stream stays in step.
                            let got: Vec<Vec<u8>> = spans
                                .iter()
                                .map(|(_, sp)| {
                                    let mut b = vec![0u8; sp.len];
                                    c.read_exact(&mut b).unwrap();
                                    b
                                })
                                .collect();
                            for ((b, _), bytes) in spans.iter().zip(&got) {
                                let want = word(req.tag, *b);
                                if let Some((i, chunk)) = bytes
                                    .chunks(8)
                                    .enumerate()
                                    .find(|(_, chunk)| *chunk != &want[..chunk.len()])
                                {
                                    mismatches.lock().unwrap().push(format!(
                                        "request {} block {}: word {i} is {chunk:?}, not its tag's {want:?}",
                                        req.id, b.0
                                    ));
                                }
                            }
                            good_reads.fetch_add(1, Ordering::Relaxed);
                        }
                        ServerMsg::Error { reason } => {
                            assert!(
                                reason.contains("freed") || reason.contains("not held"),
                                "a read of a request whose hold ended is refused as freed: {reason}"
                            );
                            refused_reads.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("unexpected answer to a read: {other:?}"),
                    }
                }
            });
        }

        // The host: free what the producer finished, refill the blocks at once for a new
        // request, hold it, repeat.
        let mut free: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
        let mut owner: std::collections::HashMap<String, Vec<BlockId>> = Default::default();
        let mut tag = 0u64;
        let mut reused = 0u64;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(4) || reused < 200 {
            for id in producer.take_finished() {
                live.lock().unwrap().retain(|l| l.id != id.0);
                free.extend(owner.remove(&id.0).unwrap_or_default());
            }
            while free.len() >= PER_REQUEST {
                tag += 1;
                let blocks: Vec<BlockId> = free.drain(..PER_REQUEST).collect();
                for (b, sp) in spans(&mem, &layers, &blocks) {
                    let w = word(tag, b);
                    let bytes = &mut regions.bytes_mut(sp.region)[sp.offset..sp.offset + sp.len];
                    for (i, x) in bytes.iter_mut().enumerate() {
                        *x = w[i % 8];
                    }
                }
                reused += 1;
                let id = format!("race-{tag}");
                let capability = format!("{tag:032x}");
                producer
                    .hold(
                        RequestId::from(id.as_str()),
                        capability.clone(),
                        &BlocksPerGroup(vec![blocks.clone()]),
                        &groups,
                    )
                    .unwrap();
                owner.insert(id.clone(), blocks.clone());
                live.lock().unwrap().push(Live { id, capability, blocks, tag });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
    });

    let m = mismatches.into_inner().unwrap();
    assert!(m.is_empty(), "{} reads shipped bytes of a reused block, first: {}", m.len(), m[0]);
    let (good, refused, done) = (good_reads.into_inner(), refused_reads.into_inner(), dones.into_inner());
    eprintln!("{good} whole reads, {refused} refused as freed, {done} dones");
    assert!(good > 100, "too few reads completed to race anything: {good}");
    assert!(refused > 0 && done > 0, "neither done nor expiry raced a read: {refused} refused, {done} dones");
}

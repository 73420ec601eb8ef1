//! The ZeroMQ publisher over real sockets: a SUB subscriber sees `(topic, seq, payload)` in
//! order, a REQ replay request gets the kept batches from its seq and the end marker, a
//! malformed request is ignored and counted; and, where the vLLM venv is present, a
//! subscriber written with pyzmq and vLLM's own decoder reads kvconnect's batches.

mod vllm_venv;

use kvconnect_api::{KvEvent, KvEventBatch, Medium};
use kvconnect_events::{decode_batch, PublisherConfig, ZmqEventPublisher, END_SEQ};
use std::process::{Command, Stdio};
use std::time::Duration;
use vllm_venv::vllm_python;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn batch(i: u64) -> KvEventBatch {
    KvEventBatch {
        ts: i as f64,
        events: vec![KvEvent::stored(vec![i], None, vec![1, 2], 2, Medium::CpuTier)],
        data_parallel_rank: Some(0),
    }
}

fn publisher(replay: bool) -> ZmqEventPublisher {
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.topic = "kv".into();
    cfg.buffer_steps = 3;
    if replay {
        cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    }
    ZmqEventPublisher::start(&cfg).unwrap()
}

fn seq_of(frame: &[u8]) -> i64 {
    i64::from_be_bytes(frame.try_into().unwrap())
}

#[tokio::test]
async fn subscribers_get_numbered_batches_and_replays() {
    let p = publisher(true);
    let mut sub = zeromq::SubSocket::new();
    sub.connect(p.endpoint()).await.unwrap();
    sub.subscribe("kv").await.unwrap();
    // A PUB drops what it sends before the subscription arrives: publish until one lands.
    let mut i = 0u64;
    let first = loop {
        p.publish(&batch(i)).unwrap();
        i += 1;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            break m;
        }
        assert!(i < 100, "no batch reached the subscriber");
    };
    let f = first.into_vec();
    assert_eq!(f.len(), 3);
    assert_eq!(&f[0][..], b"kv");
    let seq0 = seq_of(&f[1]);
    assert_eq!(decode_batch(&f[2]).unwrap(), batch(seq0 as u64), "batch n is published as seq n");
    for n in 1..=4 {
        p.publish(&batch(i)).unwrap();
        i += 1;
        let m = sub.recv().await.unwrap().into_vec();
        assert_eq!(seq_of(&m[1]), seq0 + n, "seqs count up without gaps");
        assert_eq!(decode_batch(&m[2]).unwrap(), batch((seq0 + n) as u64));
    }
    let last = i as i64 - 1;

    // Replay from an old seq: only the 3 kept batches, in order, then the end marker.
    let mut req = zeromq::ReqSocket::new();
    req.connect(p.replay_endpoint().unwrap()).await.unwrap();
    req.send(ZmqMessage::from(0u64.to_be_bytes().to_vec())).await.unwrap();
    // A REQ socket takes one reply per request: read the rest through a DEALER.
    let got = req.recv().await.unwrap().into_vec();
    assert_eq!(seq_of(&got[1]), last - 2, "the oldest kept batch comes first");
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(p.replay_endpoint().unwrap()).await.unwrap();
    let mut ask = ZmqMessage::from(Vec::<u8>::new());
    ask.push_back(((last - 1) as u64).to_be_bytes().to_vec().into());
    dealer.send(ask).await.unwrap();
    let mut seqs = Vec::new();
    loop {
        let m = dealer.recv().await.unwrap().into_vec();
        assert!(m[0].is_empty(), "the delimiter frame first: {m:?}");
        if m[2][..] == END_SEQ {
            assert!(m[1].is_empty() && m[3].is_empty(), "the end marker is (\"\", -1, \"\")");
            break;
        }
        assert_eq!(&m[1][..], b"kv");
        assert_eq!(decode_batch(&m[3]).unwrap(), batch(seq_of(&m[2]) as u64));
        seqs.push(seq_of(&m[2]));
    }
    assert_eq!(seqs, vec![last - 1, last]);

    // A malformed request is counted and ignored; the publisher keeps serving.
    let mut bad = zeromq::DealerSocket::new();
    bad.connect(p.replay_endpoint().unwrap()).await.unwrap();
    bad.send(ZmqMessage::from(b"nonsense".to_vec())).await.unwrap();
    let t0 = std::time::Instant::now();
    while p.counters().bad_replays.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the malformed request was not counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p.publish(&batch(i)).unwrap();
    let m = sub.recv().await.unwrap().into_vec();
    assert_eq!(seq_of(&m[1]), last + 1);
}

#[test]
fn bad_endpoints_are_refused_with_the_remedy() {
    for (ep, want) in [
        ("ipc:///tmp/x", "only tcp://"),
        ("tcp://127.0.0.1", "no :PORT"),
        ("tcp://127.0.0.1:99999", "0 to 65535"),
        ("tcp://:5", "no host"),
    ] {
        let err = ZmqEventPublisher::start(&PublisherConfig::new(ep)).err().expect(ep).to_string();
        assert!(err.contains(want) && err.contains("tcp://HOST:PORT"), "{ep}: {err}");
    }
    let p = publisher(false);
    let taken = p.endpoint().replace("0.0.0.0", "127.0.0.1");
    let err = ZmqEventPublisher::start(&PublisherConfig::new(taken)).err().expect("a taken port").to_string();
    assert!(err.contains("cannot bind") && err.contains("free port"), "{err}");
}

/// A subscriber as vLLM's docs write one (pyzmq SUB, `msgspec.msgpack.Decoder(KVEventBatch)`,
/// replay through a REQ... DEALER) reads kvconnect's publisher.
#[test]
fn a_vllm_subscriber_reads_kvconnect_publisher() {
    let Some(py) = vllm_python() else {
        eprintln!("{}", vllm_venv::SKIPPED);
        return;
    };
    let p = publisher(true);
    let script = r#"
import sys, time, zmq, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored
pub, replay = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB); sub.connect(pub); sub.setsockopt(zmq.SUBSCRIBE, b"kv")
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
print("ready", flush=True)
sub.setsockopt(zmq.RCVTIMEO, 30000)
topic, seq, payload = sub.recv_multipart()
b = dec.decode(payload)
e = b.events[0]
assert isinstance(e, BlockStored), e
print("live", int.from_bytes(seq, "big"), e.block_hashes, e.token_ids, e.block_size, e.medium, flush=True)
req = ctx.socket(zmq.REQ); req.connect(replay); req.send((0).to_bytes(8, "big"))
req.setsockopt(zmq.RCVTIMEO, 30000)
topic, seq, payload = req.recv_multipart()
print("replay", int.from_bytes(seq, "big"), dec.decode(payload).events[0].block_hashes, flush=True)
"#;
    let child = Command::new(&py)
        .arg("-c")
        .arg(script)
        .arg(p.endpoint())
        .arg(p.replay_endpoint().unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Publish until the subscriber has one (its subscription takes a moment to arrive).
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let d = done.clone();
    let pubber = std::thread::spawn(move || {
        let mut i = 0;
        while !d.load(std::sync::atomic::Ordering::Relaxed) && i < 600 {
            p.publish(&batch(i)).unwrap();
            i += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    pubber.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let live = text.lines().find(|l| l.starts_with("live ")).unwrap();
    let seq: u64 = live.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(live.ends_with(&format!("[{seq}] [1, 2] 2 cpu_tier")), "{live}");
    // The buffer keeps 3: the replay from 0 starts at the oldest kept.
    let replay = text.lines().find(|l| l.starts_with("replay ")).unwrap();
    let rseq: u64 = replay.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(replay.ends_with(&format!("[{rseq}]")) && rseq + 2 >= seq, "{replay} after {live}");
}

//! The msgpack codec against vLLM's own encoder: the fixture was written by vLLM's classes
//! (`vllm_golden.py`), and, where the vLLM venv is present, vLLM's decoder reads what
//! kvconnect writes.

mod vllm_venv;

use kvconnect_api::{KvEvent, KvEventBatch, Medium};
use kvconnect_events::{decode_batch, encode_batch, DecodeError};
use std::process::Command;
use vllm_venv::vllm_python;

const GOLDEN: &[u8] = include_bytes!("fixtures/vllm_batch.msgpack");

/// The batch `vllm_golden.py` builds, in kvconnect's types.
fn golden_batch() -> KvEventBatch {
    let top = u64::MAX;
    KvEventBatch {
        ts: 1767225600.25,
        events: vec![
            KvEvent::stored(vec![1, top], None, vec![1, 2, 3, 4, 70000, 6, 7, 8], 4, Medium::Gpu),
            KvEvent::stored(vec![300], Some(top), vec![9, 10, 11, 12], 4, Medium::CpuTier),
            KvEvent::removed(vec![300], Medium::CpuTier),
            KvEvent::stored(vec![300], Some(top), vec![9, 10, 11, 12], 4, Medium::Disk),
            KvEvent::removed(vec![1, top], Medium::Remote),
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(3),
    }
}

#[test]
fn writes_the_bytes_vllm_writes() {
    let ours = encode_batch(&golden_batch()).unwrap();
    assert_eq!(ours, GOLDEN, "kvconnect's bytes differ from vLLM's msgspec encoding");
}

#[test]
fn reads_the_bytes_vllm_writes() {
    assert_eq!(decode_batch(GOLDEN).unwrap(), golden_batch());
}

#[test]
fn round_trips_other_batches() {
    for batch in [
        KvEventBatch { ts: 0.0, events: vec![], data_parallel_rank: None },
        KvEventBatch {
            ts: -1.5,
            events: vec![
                KvEvent::BlockStored(kvconnect_api::BlockStored {
                    block_hashes: (0..300).map(|i| i * 0x0101_0101_0101).collect(),
                    parent_block_hash: Some(0),
                    token_ids: (0..300 * 16).collect(),
                    block_size: 16,
                    lora_id: Some(-7),
                    medium: Medium::Other("STORAGE".into()),
                }),
                KvEvent::removed(vec![], Medium::Cpu),
            ],
            data_parallel_rank: Some(i64::MAX),
        },
    ] {
        assert_eq!(decode_batch(&encode_batch(&batch).unwrap()).unwrap(), batch);
    }
}

/// What vLLM adds that kvconnect does not model is read past: later fields with values, keys
/// in another order, and sha256 hashes as bytes, folded as vLLM folds them to ints.
#[test]
fn reads_vllm_fields_it_does_not_model() {
    use rmpv::Value;
    let s = |x: &str| Value::from(x);
    let event = Value::Map(vec![
        (s("medium"), s("GPU")),
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![Value::Binary((0u8..32).collect())])),
        (s("parent_block_hash"), Value::Nil),
        (s("token_ids"), Value::Array(vec![Value::from(5)])),
        (s("block_size"), Value::from(1)),
        (s("lora_id"), Value::Nil),
        (s("lora_name"), Value::Nil),
        (s("group_idx"), Value::from(2)),
        (s("extra_keys"), Value::Array(vec![Value::Nil])),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &Value::Array(vec![Value::F64(2.0), Value::Array(vec![event])]))
        .unwrap();
    let batch = decode_batch(&bytes).unwrap();
    let KvEvent::BlockStored(st) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!(st.block_hashes, vec![u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31])]);
    assert_eq!(st.medium, Medium::Gpu);
    assert_eq!(batch.data_parallel_rank, None);
}

#[test]
fn malformed_batches_get_an_error_that_names_the_fault() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "not a msgpack value"),
        (GOLDEN[..GOLDEN.len() - 3].to_vec(), "not a msgpack value"),
        ([GOLDEN, &[0xc0]].concat(), "1 bytes follow the batch"),
        (vec![0x81, 0xa1, b'a', 0x01], "the batch: expected an array"),
        (vec![0x93, 0xa1, b'x', 0x90, 0xc0], "ts: expected a float"),
        // An event of an unknown type.
        (
            [&[0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x81, 0xa4][..], b"type", &[0xa4], b"Oops", &[0xc0]]
                .concat(),
            "unknown event type \"Oops\"",
        ),
        // A BlockRemoved without its medium.
        (
            [
                &[0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x82, 0xa4][..],
                b"type",
                &[0xac],
                b"BlockRemoved",
                &[0xac],
                b"block_hashes",
                &[0x90, 0xc0],
            ]
            .concat(),
            "events[0]: the field `medium` is missing",
        ),
        // An array that claims 2^32-1 items and holds none: refused, not allocated.
        (vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff], "not a msgpack value"),
        // Nested far past a batch's depth.
        ([vec![0x91; 10_000], vec![0xc0]].concat(), "not a msgpack value"),
    ];
    for (bytes, want) in cases {
        let err: DecodeError = decode_batch(&bytes).expect_err(want);
        assert!(err.to_string().contains(want), "{err} should say {want:?}");
    }
}

/// vLLM's own decoder (`msgspec.msgpack.Decoder(KVEventBatch)`) reads kvconnect's bytes and
/// finds the same events.
#[test]
fn vllm_decodes_what_kvconnect_writes() {
    let Some(py) = vllm_python() else {
        eprintln!("{}", vllm_venv::SKIPPED);
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvc-events-codec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("batch.msgpack");
    std::fs::write(&file, encode_batch(&golden_batch()).unwrap()).unwrap();
    let script = r#"
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
b = msgspec.msgpack.Decoder(KVEventBatch).decode(open(sys.argv[1], 'rb').read())
print(b.ts, b.data_parallel_rank)
for e in b.events:
    if isinstance(e, BlockStored):
        print('S', e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium)
    elif isinstance(e, BlockRemoved):
        print('R', e.block_hashes, e.medium)
    else:
        assert isinstance(e, AllBlocksCleared)
        print('C')
"#;
    let out = Command::new(&py).arg("-c").arg(script).arg(&file).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "vLLM's decoder failed: {}", String::from_utf8_lossy(&out.stderr));
    let top = u64::MAX;
    let want = format!(
        "1767225600.25 3\n\
         S [1, {top}] None [1, 2, 3, 4, 70000, 6, 7, 8] 4 GPU\n\
         S [300] {top} [9, 10, 11, 12] 4 cpu_tier\n\
         R [300] cpu_tier\n\
         S [300] {top} [9, 10, 11, 12] 4 disk\n\
         R [1, {top}] remote\n\
         C\n"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
}

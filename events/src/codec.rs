//! vLLM's `KVEventBatch` in msgpack, byte for byte as msgspec writes it.
//!
//! `vllm/distributed/kv_events.py` declares the batch `array_like=True, omit_defaults=True`
//! and each event `omit_defaults=True, tag=True`: a batch is the array `[ts, events,
//! data_parallel_rank]`, and an event is a map whose first key is `type` (the class name),
//! followed by its fields in declaration order, the fields without a default always written
//! (as nil when `None`) and those with a default left out while they hold it. The decoder
//! reads what msgspec reads: keys in any order, unknown keys ignored, a hash as an integer or
//! as bytes (vLLM's sha256 hashes, folded to their low 64 bits as vLLM's
//! `maybe_convert_block_hash` does).

use kvconnect_api::{BlockHash, BlockRemoved, BlockStored, KvEvent, KvEventBatch, Medium};
use rmp::encode;
use rmpv::Value;

/// A batch that cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// A list longer than msgpack can say.
    #[error("{what} has {len} entries, more than msgpack's 2^32-1: publish it in smaller batches")]
    TooLong {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
    },
}

/// Bytes that are not a `KVEventBatch`.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack at all, truncated, or nested past the decoder's depth limit.
    #[error("the payload is not a msgpack value ({0}): a KV event batch is msgpack as vLLM's KVEventBatch")]
    Msgpack(String),
    /// Bytes left after the batch.
    #[error("{0} bytes follow the batch: one ZeroMQ payload frame holds exactly one KVEventBatch")]
    Trailing(usize),
    /// A value of the wrong shape.
    #[error("{at}: expected {expected}, found {found}: the batch is not vLLM's KVEventBatch layout")]
    Shape {
        /// Where, e.g. `events[2].block_hashes[0]`.
        at: String,
        /// What should be there.
        expected: &'static str,
        /// What is there.
        found: String,
    },
    /// A required field is missing.
    #[error("{at}: the field `{field}` is missing; vLLM always writes it")]
    Missing {
        /// The event.
        at: String,
        /// The field.
        field: &'static str,
    },
    /// An event type this decoder does not know.
    #[error("{at}: unknown event type {tag:?}; known: BlockStored, BlockRemoved, AllBlocksCleared")]
    UnknownType {
        /// The event.
        at: String,
        /// Its `type`.
        tag: String,
    },
}

/// The batch in msgpack, as vLLM's `msgspec.msgpack.Encoder().encode(batch)` writes it.
pub fn encode_batch(batch: &KvEventBatch) -> Result<Vec<u8>, EncodeError> {
    let mut w = Vec::with_capacity(64 + batch.events.len() * 64);
    array_len(&mut w, 3, "the batch")?;
    write(encode::write_f64(&mut w, batch.ts));
    array_len(&mut w, batch.events.len(), "the batch's events")?;
    for e in &batch.events {
        write_event(&mut w, e)?;
    }
    match batch.data_parallel_rank {
        Some(r) => write(encode::write_sint(&mut w, r).map(drop)),
        None => write(encode::write_nil(&mut w)),
    }
    Ok(w)
}

fn write_event(w: &mut Vec<u8>, e: &KvEvent) -> Result<(), EncodeError> {
    match e {
        KvEvent::BlockStored(s) => {
            map_len(w, 8);
            key(w, "type");
            str(w, "BlockStored");
            key(w, "block_hashes");
            hashes(w, &s.block_hashes)?;
            key(w, "parent_block_hash");
            opt_uint(w, s.parent_block_hash);
            key(w, "token_ids");
            array_len(w, s.token_ids.len(), "token_ids")?;
            for &t in &s.token_ids {
                uint(w, u64::from(t));
            }
            key(w, "block_size");
            uint(w, u64::from(s.block_size));
            key(w, "lora_id");
            match s.lora_id {
                Some(id) => write(encode::write_sint(w, id).map(drop)),
                None => write(encode::write_nil(w)),
            }
            key(w, "medium");
            medium_out(w, &s.medium);
            // `lora_name`: a field without a default, always written; kvconnect names no
            // adapter.
            key(w, "lora_name");
            write(encode::write_nil(w));
        }
        KvEvent::BlockRemoved(r) => {
            map_len(w, 3);
            key(w, "type");
            str(w, "BlockRemoved");
            key(w, "block_hashes");
            hashes(w, &r.block_hashes)?;
            key(w, "medium");
            medium_out(w, &r.medium);
        }
        KvEvent::AllBlocksCleared => {
            map_len(w, 1);
            key(w, "type");
            str(w, "AllBlocksCleared");
        }
    }
    Ok(())
}

// Writes into a `Vec` cannot fail; only lengths past u32 can, checked before.
fn write<E>(r: Result<(), E>) {
    let _ = r;
}

fn array_len(w: &mut Vec<u8>, len: usize, what: &'static str) -> Result<(), EncodeError> {
    let n = u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })?;
    write(encode::write_array_len(w, n).map(drop));
    Ok(())
}

fn map_len(w: &mut Vec<u8>, len: u32) {
    write(encode::write_map_len(w, len).map(drop));
}

fn key(w: &mut Vec<u8>, k: &str) {
    str(w, k);
}

fn str(w: &mut Vec<u8>, s: &str) {
    write(encode::write_str(w, s));
}

fn uint(w: &mut Vec<u8>, v: u64) {
    write(encode::write_uint(w, v).map(drop));
}

fn opt_uint(w: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => uint(w, v),
        None => write(encode::write_nil(w)),
    }
}

/// An unspecified medium (vLLM's `None`, decoded as an empty name) is written back as nil.
fn medium_out(w: &mut Vec<u8>, m: &Medium) {
    match m.as_str() {
        "" => write(encode::write_nil(w)),
        s => str(w, s),
    }
}

fn hashes(w: &mut Vec<u8>, hs: &[BlockHash]) -> Result<(), EncodeError> {
    array_len(w, hs.len(), "block_hashes")?;
    for &h in hs {
        uint(w, h);
    }
    Ok(())
}

/// Nesting a batch never needs more than this (batch, events, event, field list); deeper
/// input is refused before it can exhaust the stack.
const MAX_DEPTH: usize = 16;

/// Reads one `KVEventBatch`, as vLLM's `msgspec.msgpack.Decoder(KVEventBatch)` would.
pub fn decode_batch(bytes: &[u8]) -> Result<KvEventBatch, DecodeError> {
    let mut rd = bytes;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::Trailing(rd.len()));
    }
    let Value::Array(items) = v else {
        return Err(shape("the batch", "an array [ts, events, data_parallel_rank]", &v));
    };
    if items.len() < 2 || items.len() > 3 {
        return Err(DecodeError::Shape {
            at: "the batch".into(),
            expected: "an array of 2 or 3 items [ts, events, data_parallel_rank]",
            found: format!("an array of {}", items.len()),
        });
    }
    let ts = match &items[0] {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().unwrap_or(f64::NAN),
        other => return Err(shape("ts", "a float", other)),
    };
    let Value::Array(evs) = &items[1] else {
        return Err(shape("events", "an array", &items[1]));
    };
    let events = evs
        .iter()
        .enumerate()
        .map(|(i, e)| decode_event(&format!("events[{i}]"), e))
        .collect::<Result<Vec<_>, _>>()?;
    let data_parallel_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => {
            Some(i.as_i64().ok_or_else(|| shape("data_parallel_rank", "an int64", &items[2]))?)
        }
        Some(other) => return Err(shape("data_parallel_rank", "an int or nil", other)),
    };
    Ok(KvEventBatch { ts, events, data_parallel_rank })
}

fn decode_event(at: &str, v: &Value) -> Result<KvEvent, DecodeError> {
    let Value::Map(fields) = v else {
        return Err(shape(at, "a map with a `type` key (a tagged KVCacheEvent)", v));
    };
    let get = |name: &str| fields.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v);
    let need = |name: &'static str| get(name).ok_or(DecodeError::Missing { at: at.to_owned(), field: name });
    let tag = need("type")?;
    let tag = tag.as_str().ok_or_else(|| shape(&format!("{at}.type"), "a string", tag))?;
    match tag {
        "BlockStored" => {
            let token_ids = list(at, "token_ids", need("token_ids")?)?
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| shape(&format!("{at}.token_ids[{i}]"), "a token id (u32)", t))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let bs = need("block_size")?;
            let block_size = bs
                .as_u64()
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| shape(&format!("{at}.block_size"), "a block size (u32)", bs))?;
            let lora_id = match need("lora_id")? {
                Value::Nil => None,
                l => Some(l.as_i64().ok_or_else(|| shape(&format!("{at}.lora_id"), "an int or nil", l))?),
            };
            Ok(KvEvent::BlockStored(BlockStored {
                block_hashes: block_hashes(at, need("block_hashes")?)?,
                parent_block_hash: match need("parent_block_hash")? {
                    Value::Nil => None,
                    p => Some(hash(&format!("{at}.parent_block_hash"), p)?),
                },
                token_ids,
                block_size,
                lora_id,
                medium: medium(at, need("medium")?)?,
            }))
        }
        "BlockRemoved" => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: block_hashes(at, need("block_hashes")?)?,
            medium: medium(at, need("medium")?)?,
        })),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(DecodeError::UnknownType { at: at.to_owned(), tag: other.to_owned() }),
    }
}

fn list<'a>(at: &str, field: &str, v: &'a Value) -> Result<&'a [Value], DecodeError> {
    v.as_array().map(Vec::as_slice).ok_or_else(|| shape(&format!("{at}.{field}"), "an array", v))
}

fn block_hashes(at: &str, v: &Value) -> Result<Vec<BlockHash>, DecodeError> {
    list(at, "block_hashes", v)?
        .iter()
        .enumerate()
        .map(|(i, h)| hash(&format!("{at}.block_hashes[{i}]"), h))
        .collect()
}

/// An int hash as it is; a bytes hash (vLLM's sha256) folded to its low 64 bits, big-endian,
/// as `maybe_convert_block_hash` does under `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`.
fn hash(at: &str, v: &Value) -> Result<BlockHash, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|n| n as u64))
            .ok_or_else(|| shape(at, "a block hash (int or bytes)", v)),
        Value::Binary(b) => Ok(b.iter().rev().take(8).rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x))),
        other => Err(shape(at, "a block hash (int or bytes)", other)),
    }
}

fn medium(at: &str, v: &Value) -> Result<Medium, DecodeError> {
    match v {
        Value::String(s) => {
            s.as_str().map(Medium::parse).ok_or_else(|| shape(&format!("{at}.medium"), "a UTF-8 string", v))
        }
        // vLLM allows `None` ("unspecified"); every publisher it ships names one.
        Value::Nil => Ok(Medium::Other(String::new())),
        other => Err(shape(&format!("{at}.medium"), "a string", other)),
    }
}

fn shape(at: &str, expected: &'static str, found: &Value) -> DecodeError {
    let found = match found {
        Value::Nil => "nil".to_owned(),
        Value::Boolean(b) => format!("the bool {b}"),
        Value::Integer(i) => format!("the int {i}"),
        Value::F32(_) | Value::F64(_) => "a float".to_owned(),
        Value::String(_) => "a string".to_owned(),
        Value::Binary(b) => format!("{} bytes", b.len()),
        Value::Array(a) => format!("an array of {}", a.len()),
        Value::Map(m) => format!("a map of {}", m.len()),
        Value::Ext(t, _) => format!("an ext value of type {t}"),
    };
    DecodeError::Shape { at: at.to_owned(), expected, found }
}

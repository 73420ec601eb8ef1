//! The SSD tier's storage: fixed-size records in one file.
//!
//! `ssd_cache_dir` names a directory (created if missing; the tier makes
//! `flexkv-<engine>-<pid>.ssd` in it and removes it when the cache is dropped) or an existing
//! non-directory file such as a preallocated file or a block device (used in place, never
//! removed). Record `i` sits at `i * record_bytes`: a 4 KiB page whose first 32 bytes are
//! the header (magic, block hash, payload length, payload checksum), then the payload,
//! padded to 4 KiB, so payload I/O is page aligned. A record whose
//! header or checksum disagrees is reported as corrupt, so a torn write, a full disk or a
//! flipped bit is a cache miss, never KV loaded into an engine.

use crate::hash::Checksum;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: u64 = 0x3142_4b56_5845_4c46; // "FLEXKVB1" little-endian
const HEADER: usize = 32;
const ALIGN: u64 = 4096;
/// Payloads are written and verified in pieces of this size, each checksummed while it is
/// still in cache.
const PIECE: usize = 256 * 1024;

/// The tier cannot be opened.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SsdError {
    /// The directory or file cannot be created or opened for writing.
    #[error("ssd_cache_dir '{path}': {reason}; point ssd_cache_dir at a writable directory, or set ssd_cache_gb to 0 to run without the SSD tier")]
    Open {
        /// The path.
        path: String,
        /// The OS error.
        reason: String,
    },
    /// The budget holds no record.
    #[error("ssd_cache_gb = {gb} holds no block: one block record is {record} bytes; raise ssd_cache_gb or set it to 0")]
    TooSmall {
        /// The budget in GB.
        gb: f64,
        /// Bytes per record.
        record: u64,
    },
}

/// Why a record could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SsdReadError {
    /// The read failed.
    #[error("reading SSD record {slot}: {reason}")]
    Io {
        /// The slot.
        slot: u32,
        /// The OS error.
        reason: String,
    },
    /// The record is not the block it should be.
    #[error("SSD record {slot} is corrupt: {reason}")]
    Corrupt {
        /// The slot.
        slot: u32,
        /// Which check failed.
        reason: String,
    },
}

/// Record storage of the SSD tier.
pub struct SsdTier {
    file: File,
    path: PathBuf,
    owned: bool,
    payload: usize,
    record: u64,
    num_slots: u32,
}

impl SsdTier {
    /// Bytes one record takes for a payload of `payload` bytes.
    pub fn record_bytes(payload: usize) -> u64 {
        ALIGN + (payload as u64).div_ceil(ALIGN) * ALIGN
    }

    /// Opens the tier at `path` (see the module doc) for payloads of `payload` bytes within
    /// `budget_bytes`.
    pub fn open(path: &Path, tag: &str, payload: usize, budget_bytes: u64) -> Result<SsdTier, SsdError> {
        let record = Self::record_bytes(payload);
        let num_slots = (budget_bytes / record).min(u32::MAX as u64 - 1) as u32;
        if num_slots == 0 {
            return Err(SsdError::TooSmall { gb: budget_bytes as f64 / (1u64 << 30) as f64, record });
        }
        let err =
            |e: std::io::Error| SsdError::Open { path: path.display().to_string(), reason: e.to_string() };
        let (file_path, owned) = match std::fs::metadata(path) {
            Ok(m) if !m.is_dir() => (path.to_path_buf(), false),
            Ok(_) => (path.join(file_name(tag)), true),
            Err(_) => {
                std::fs::create_dir_all(path).map_err(err)?;
                (path.join(file_name(tag)), true)
            }
        };
        let mut opts = OpenOptions::new();
        opts.read(true).write(true);
        if owned {
            opts.create(true).truncate(true);
        }
        let file = opts
            .open(&file_path)
            .map_err(|e| SsdError::Open { path: file_path.display().to_string(), reason: e.to_string() })?;
        Ok(SsdTier { file, path: file_path, owned, payload, record, num_slots })
    }

    /// Records the budget holds.
    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// The file in use.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes per record on disk.
    pub fn record(&self) -> u64 {
        self.record
    }

    /// Writes block `hash`'s payload into record `slot`, checksumming it on the way.
    pub fn write(&self, slot: u32, hash: u64, payload: &[u8]) -> std::io::Result<()> {
        self.write_inner(slot, hash, payload, None)
    }

    /// Writes a payload whose [`crate::hash::checksum`] the caller already has (taken when
    /// the bytes were hot): one pass over the bytes, the kernel's copy.
    pub fn write_summed(&self, slot: u32, hash: u64, payload: &[u8], sum: u64) -> std::io::Result<()> {
        self.write_inner(slot, hash, payload, Some(sum))
    }

    fn write_inner(&self, slot: u32, hash: u64, payload: &[u8], known: Option<u64>) -> std::io::Result<()> {
        if slot >= self.num_slots || payload.len() != self.payload {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("record {slot} of {} bytes does not fit the tier", payload.len()),
            ));
        }
        let off = slot as u64 * self.record;
        // Payload first, header last: a write torn in between leaves an old or absent
        // header, which fails verification instead of vouching for half a payload.
        let mut sum = Checksum::new();
        let mut at = off + ALIGN;
        for piece in payload.chunks(PIECE) {
            if known.is_none() {
                sum.update(piece);
            }
            self.file.write_all_at(piece, at)?;
            at += piece.len() as u64;
        }
        let mut h = [0u8; HEADER];
        h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        h[8..16].copy_from_slice(&hash.to_le_bytes());
        h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[24..32].copy_from_slice(&known.unwrap_or_else(|| sum.finish()).to_le_bytes());
        self.file.write_all_at(&h, off)
    }

    /// Reads record `slot` into `buf` and checks that it holds block `hash` intact; returns
    /// the payload (a slice of `buf`). The header page and the first piece of the payload
    /// come in one read.
    pub fn read<'b>(&self, slot: u32, hash: u64, buf: &'b mut Vec<u8>) -> Result<&'b [u8], SsdReadError> {
        if slot >= self.num_slots {
            return Err(SsdReadError::Io { slot, reason: "slot past the end of the tier".into() });
        }
        let page = ALIGN as usize;
        buf.resize(page + self.payload, 0);
        let off = slot as u64 * self.record;
        let io = |e: std::io::Error| SsdReadError::Io { slot, reason: e.to_string() };
        let first = (page + PIECE).min(buf.len());
        self.file.read_exact_at(&mut buf[..first], off).map_err(io)?;
        let mut sum = Checksum::new();
        sum.update(&buf[page..first]);
        let mut at = off + first as u64;
        for piece in buf[first..].chunks_mut(PIECE) {
            self.file.read_exact_at(piece, at).map_err(io)?;
            sum.update(piece);
            at += piece.len() as u64;
        }
        let header = &buf[..HEADER];
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&header[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        let corrupt = |reason: String| SsdReadError::Corrupt { slot, reason };
        if word(0) != MAGIC {
            return Err(corrupt("bad magic".into()));
        }
        if word(1) != hash {
            return Err(corrupt(format!("holds block {:016x}, expected {hash:016x}", word(1))));
        }
        if word(2) != self.payload as u64 {
            return Err(corrupt(format!("length {} instead of {}", word(2), self.payload)));
        }
        if word(3) != sum.finish() {
            return Err(corrupt("checksum mismatch".into()));
        }
        Ok(&buf[page..])
    }
}

impl Drop for SsdTier {
    fn drop(&mut self) {
        if self.owned {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn file_name(tag: &str) -> String {
    let clean: String = tag
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .collect();
    format!("flexkv-{}-{}.ssd", clean, std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let t = SsdTier::open(&dir.path().join("sub"), "e/1", 100, 3 * 8192).unwrap();
        assert_eq!(t.num_slots(), 3);
        let data: Vec<u8> = (0..100).collect();
        t.write(2, 77, &data).unwrap();
        let mut buf = Vec::new();
        assert_eq!(t.read(2, 77, &mut buf).unwrap(), &data[..]);
        // A precomputed checksum gives the same record; a wrong one is caught on read.
        t.write_summed(1, 5, &data, crate::hash::checksum(&data)).unwrap();
        assert_eq!(t.read(1, 5, &mut buf).unwrap(), &data[..]);
        t.write_summed(0, 6, &data, 1234).unwrap();
        assert!(matches!(t.read(0, 6, &mut buf), Err(SsdReadError::Corrupt { .. })));
        assert!(matches!(t.read(2, 78, &mut buf), Err(SsdReadError::Corrupt { .. })));
        assert!(matches!(t.read(1, 0, &mut buf), Err(SsdReadError::Corrupt { .. })));
        // Flip one payload byte on disk.
        let f = OpenOptions::new().write(true).open(t.path()).unwrap();
        f.write_all_at(&[0xff], 2 * 8192 + 4096 + 50).unwrap();
        let e = t.read(2, 77, &mut buf).unwrap_err();
        assert!(e.to_string().contains("checksum mismatch"), "{e}");
        let p = t.path().to_path_buf();
        drop(t);
        assert!(!p.exists(), "owned file is removed");
    }

    #[test]
    fn unusable_paths_and_budgets_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        let e = SsdTier::open(&file.join("sub"), "e", 10, 1 << 20).err().unwrap();
        assert!(e.to_string().contains("point ssd_cache_dir at a writable directory"), "{e}");
        let e = SsdTier::open(dir.path(), "e", 10, 100).err().unwrap();
        assert!(matches!(e, SsdError::TooSmall { .. }), "{e}");
    }
}

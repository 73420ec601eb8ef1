//! The SSD tier's storage: fixed-size records in one file.
//!
//! `ssd_cache_dir` names a directory or an existing non-directory file.
//!
//! * A directory (created with mode 0700 if missing) may be shared by several workers: each
//!   makes its own subdirectory `flexkv-<engine>-<random>` in it (mode 0700, locked while
//!   the worker runs, [`CacheDir::create_unique`]) and its record file `tier.ssd` in that
//!   (mode 0600, O_EXCL|O_NOFOLLOW). The tier lasts as long as the worker: its subdirectory
//!   is removed when the cache is dropped, and one left by a worker that crashed is removed
//!   by the next worker that starts on the directory.
//! * A file such as a preallocated file or a block device is used in place, never removed,
//!   and locked: a second worker naming the same file is refused.
//!
//! Record `i` sits at `i * record_bytes`: a 4 KiB page whose first 32 bytes are
//! the header (magic, block hash, payload length, payload checksum), then the payload,
//! padded to 4 KiB, so payload I/O is page aligned. A record whose
//! header or checksum disagrees is reported as corrupt, so a torn write, a full disk or a
//! flipped bit is a cache miss, never KV loaded into an engine.
//!
//! Writes go through the page cache and are durable only after [`SsdTier::sync`]: the cache
//! writes a batch of records, syncs once, and only then lets them into its index.
//! (`O_DIRECT` was measured here and lost: a direct write plus `fdatasync` of 8 MiB took
//! about twice as long as a buffered write plus `fdatasync`, and direct reads go to the
//! device where buffered reads of recent records come from memory.)

use crate::hash::Checksum;
use kvconnect_cache_dir::{create_private, sync_file, try_lock, CacheDir, CacheDirError};
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
#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    /// The directory or file cannot be created or opened for writing.
    #[error(
        "ssd_cache_dir '{path}': {reason}; point ssd_cache_dir at a writable directory, or set \
        ssd_cache_gb to 0 to run without the SSD tier"
    )]
    Open {
        /// The path.
        path: String,
        /// The OS error.
        reason: String,
    },
    /// The directory cannot be made this worker's.
    #[error(transparent)]
    Dir(#[from] CacheDirError),
    /// Another worker uses the file.
    #[error(
        "ssd_cache_dir '{path}' is a file another worker is using; give each worker its own file, or \
        name a directory (workers can share one)"
    )]
    Busy {
        /// The file.
        path: String,
    },
    /// The budget holds no record.
    #[error(
        "ssd_cache_gb = {gb} holds no block: one block record is {record} bytes; raise ssd_cache_gb or \
        set it to 0"
    )]
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

/// What [`SsdTier::read_into`] gives back: the verified payload, or the copy's own error.
pub type ReadInto<'b, E> = Result<Result<&'b [u8], E>, SsdReadError>;

/// Record storage of the SSD tier.
pub struct SsdTier {
    file: File,
    path: PathBuf,
    /// This worker's subdirectory, when `ssd_cache_dir` is a directory; removed on drop.
    owned: Option<CacheDir>,
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
        let open_err = |p: &Path, e: std::io::Error| SsdError::Open {
            path: p.display().to_string(),
            reason: e.to_string(),
        };
        let (file, file_path, owned) = match std::fs::metadata(path) {
            Ok(m) if !m.is_dir() => {
                // Named by the user: used in place (a block device's name is often a symlink).
                let file =
                    OpenOptions::new().read(true).write(true).open(path).map_err(|e| open_err(path, e))?;
                if !try_lock(&file).map_err(|e| open_err(path, e))? {
                    return Err(SsdError::Busy { path: path.display().to_string() });
                }
                (file, path.to_path_buf(), None)
            }
            _ => {
                let dir = CacheDir::create_unique(path, &format!("flexkv-{}", clean(tag)), "ssd_cache_dir")?;
                let file_path = dir.path().join("tier.ssd");
                let file = create_private(&file_path).map_err(|e| open_err(&file_path, e))?;
                // The file's creation is durable before any record is written to it.
                sync_file(&file).and_then(|()| dir.sync()).map_err(|e| open_err(&file_path, e))?;
                (file, file_path, Some(dir))
            }
        };
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

    /// Writes block `hash`'s payload into record `slot`, checksumming it on the way. Not
    /// durable until [`SsdTier::sync`].
    pub fn write(&self, slot: u32, hash: u64, payload: &[u8]) -> std::io::Result<()> {
        self.write_inner(slot, hash, payload, None)
    }

    /// Writes a payload whose [`crate::hash::checksum`] the caller already has (taken when
    /// the bytes were hot): one pass over the bytes, the kernel's copy. Not durable until
    /// [`SsdTier::sync`].
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

    /// Makes every record written so far durable (`fdatasync`): the cache calls it before a
    /// written record enters its index.
    pub fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()
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
        check_header(&buf[..HEADER], hash, self.payload, sum.finish())
            .map_err(|reason| SsdReadError::Corrupt { slot, reason })?;
        Ok(&buf[page..])
    }

    /// Reads record `slot` into `buf` (one read) and hands its payload to `copy`, which
    /// copies it where it goes and returns the [`crate::hash::checksum`] of the bytes it
    /// copied, taken in the same pass ([`crate::adapter::BlockAdapter::scatter_summed`]), so
    /// the payload is read from memory once; then checks the record is block `hash` intact.
    /// Returns the verified payload (a slice of `buf`), `Ok(Err(e))` where `copy` failed, or
    /// the tier's error. The header (magic, block, length) is checked before `copy` runs, the
    /// checksum after it: on a checksum mismatch `copy` has already written the bytes, which
    /// the caller must treat as not loaded (a failed block load, recomputed by the engine).
    pub fn read_into<'b, E>(
        &self,
        slot: u32,
        hash: u64,
        buf: &'b mut Vec<u8>,
        copy: impl FnOnce(&[u8]) -> Result<u64, E>,
    ) -> ReadInto<'b, E> {
        if slot >= self.num_slots {
            return Err(SsdReadError::Io { slot, reason: "slot past the end of the tier".into() });
        }
        let page = ALIGN as usize;
        buf.resize(page + self.payload, 0);
        let off = slot as u64 * self.record;
        self.file.read_exact_at(buf, off).map_err(|e| SsdReadError::Io { slot, reason: e.to_string() })?;
        let corrupt = |reason| SsdReadError::Corrupt { slot, reason };
        let recorded = check_fields(&buf[..HEADER], hash, self.payload).map_err(corrupt)?;
        let payload = &buf[page..];
        let sum = match copy(payload) {
            Ok(sum) => sum,
            Err(e) => return Ok(Err(e)),
        };
        check_sum(recorded, sum).map_err(corrupt)?;
        Ok(Ok(payload))
    }
}

impl Drop for SsdTier {
    fn drop(&mut self) {
        if let Some(dir) = &self.owned {
            let _ = std::fs::remove_dir_all(dir.path());
        }
    }
}

/// Checks a record's header: that it holds block `hash`, `payload` bytes long, whose
/// checksum is `sum`.
fn check_header(header: &[u8], hash: u64, payload: usize, sum: u64) -> Result<(), String> {
    check_sum(check_fields(header, hash, payload)?, sum)
}

/// Checks a record's header but for its checksum: that it holds block `hash`, `payload`
/// bytes long; returns the checksum it records.
fn check_fields(header: &[u8], hash: u64, payload: usize) -> Result<u64, String> {
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&header[i * 8..i * 8 + 8]);
        u64::from_le_bytes(w)
    };
    if header.len() < HEADER {
        return Err(format!("header of {} bytes, a record's is {HEADER}", header.len()));
    }
    if word(0) != MAGIC {
        return Err("bad magic".into());
    }
    if word(1) != hash {
        return Err(format!("holds block {:016x}, expected {hash:016x}", word(1)));
    }
    if word(2) != payload as u64 {
        return Err(format!("length {} instead of {payload}", word(2)));
    }
    Ok(word(3))
}

fn check_sum(recorded: u64, sum: u64) -> Result<(), String> {
    if recorded != sum {
        return Err("checksum mismatch".into());
    }
    Ok(())
}

/// Checks a whole record as the file holds it (the header page, then the payload) for
/// block `hash`: the payload, or what is wrong. The tier's reads check the same, piece by
/// piece as they arrive.
pub fn check_record(record: &[u8], hash: u64) -> Result<&[u8], String> {
    let page = ALIGN as usize;
    if record.len() < page {
        return Err(format!("record of {} bytes is shorter than its {page}-byte header page", record.len()));
    }
    let payload = &record[page..];
    check_header(&record[..HEADER], hash, payload.len(), crate::hash::checksum(payload))?;
    Ok(payload)
}

/// The engine id as a file-name part.
fn clean(tag: &str) -> String {
    tag.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
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
        // Read into place: the copy's checksum decides, the header is checked before it runs.
        fn sum_copy(out: &mut Vec<u8>) -> impl FnOnce(&[u8]) -> Result<u64, String> + '_ {
            move |p: &[u8]| {
                out.extend_from_slice(p);
                Ok(crate::hash::checksum(p))
            }
        }
        let mut out = Vec::new();
        assert_eq!(t.read_into(1, 5, &mut buf, sum_copy(&mut out)).unwrap().unwrap(), &data[..]);
        assert_eq!(out, data);
        let e = t.read_into(2, 77, &mut buf, sum_copy(&mut Vec::new())).unwrap_err();
        assert!(e.to_string().contains("SSD record 2 is corrupt: checksum mismatch"), "{e}");
        let mut never = false;
        let e = t
            .read_into(1, 6, &mut buf, |_| {
                never = true;
                Ok::<u64, String>(0)
            })
            .unwrap_err();
        assert!(e.to_string().contains("holds block") && !never, "{e}");
        let r = t.read_into(1, 5, &mut buf, |_| Err::<u64, String>("sink failed".into())).unwrap();
        assert_eq!(r.unwrap_err(), "sink failed");
        assert!(matches!(
            t.read_into(9, 5, &mut buf, sum_copy(&mut Vec::new())),
            Err(SsdReadError::Io { .. })
        ));
        let p = t.path().to_path_buf();
        drop(t);
        assert!(!p.exists(), "owned file is removed");
    }

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_tier_is_private_and_unpredictable_and_workers_share_a_directory() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ssd");
        let a = SsdTier::open(&dir, "e/1", 100, 3 * 8192).unwrap();
        let b = SsdTier::open(&dir, "e/1", 100, 3 * 8192).unwrap();
        assert_eq!(mode(&dir), 0o700);
        for t in [&a, &b] {
            assert_eq!(mode(t.path()), 0o600);
            assert_eq!(mode(t.path().parent().unwrap()), 0o700);
            let sub = t.path().parent().unwrap().file_name().unwrap().to_string_lossy().into_owned();
            assert!(sub.starts_with("flexkv-e_1-") && sub.len() == "flexkv-e_1-".len() + 16, "{sub}");
        }
        assert_ne!(a.path(), b.path(), "two workers on one directory get their own files");
        a.write(0, 1, &[1u8; 100]).unwrap();
        b.write(0, 2, &[2u8; 100]).unwrap();
        let mut buf = Vec::new();
        assert_eq!(a.read(0, 1, &mut buf).unwrap(), &[1u8; 100][..]);
        assert_eq!(b.read(0, 2, &mut buf).unwrap(), &[2u8; 100][..]);
    }

    #[test]
    fn a_symlink_at_the_old_predictable_name_is_not_followed() {
        // The tier used to create (and truncate) flexkv-<engine>-<pid>.ssd: a link planted
        // there made it truncate any file its user could write.
        let root = tempfile::tempdir().unwrap();
        let victim = root.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let dir = root.path().join("ssd");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(format!("flexkv-e-{}.ssd", std::process::id())))
            .unwrap();
        let t = SsdTier::open(&dir, "e", 100, 3 * 8192).unwrap();
        t.write(0, 1, &[9u8; 100]).unwrap();
        drop(t);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn a_file_named_by_two_workers_is_refused_for_the_second() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("prealloc");
        std::fs::write(&file, vec![0u8; 3 * 8192]).unwrap();
        let first = SsdTier::open(&file, "e", 100, 3 * 8192).unwrap();
        let e = SsdTier::open(&file, "e", 100, 3 * 8192).err().unwrap();
        assert!(matches!(e, SsdError::Busy { .. }) && e.to_string().contains("another worker"), "{e}");
        drop(first);
        assert!(file.exists(), "a file named by the user is never removed");
        SsdTier::open(&file, "e", 100, 3 * 8192).expect("free once the first is gone");
    }

    #[test]
    fn whole_records_are_checked_like_reads() {
        let dir = tempfile::tempdir().unwrap();
        let t = SsdTier::open(dir.path(), "e", 100, 3 * 8192).unwrap();
        let data: Vec<u8> = (0..100).collect();
        t.write(0, 9, &data).unwrap();
        let mut rec = vec![0u8; 4096 + 100];
        t.file.read_exact_at(&mut rec, 0).unwrap();
        assert_eq!(check_record(&rec, 9).unwrap(), &data[..]);
        assert!(check_record(&rec, 8).unwrap_err().contains("expected"));
        assert!(check_record(&rec[..4196 - 1], 9).unwrap_err().contains("length 100 instead of 99"));
        assert!(check_record(&rec[..100], 9).unwrap_err().contains("shorter"));
        rec[4096] ^= 1;
        assert_eq!(check_record(&rec, 9).unwrap_err(), "checksum mismatch");
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

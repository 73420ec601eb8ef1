//! The local-disk tier: one file per chunk, `<key>.chunk`: a header carrying the key and the
//! length (guarded by a hash of its own), the bytes, and a trailer with their checksum
//! (`kvconnect_support::stable_hash::Checksum`, additions in SIMD lanes: computed while the
//! bytes stream through the cache on their way to or from the file, so checking costs no
//! extra pass over memory and little time beside the copy).
//!
//! The index is rebuilt from the files' headers when the tier opens, so it survives a
//! restart; the order of last use is taken from the files' modification times. A file is
//! written under a temporary name, fsync'd, and renamed into place, so a crash leaves either
//! the whole chunk or nothing under the final name, and nothing enters the index before it
//! is durable. Every read checks the header and the checksum: a corrupt or truncated file
//! is deleted and reported as a miss, never returned.
//!
//! The directory is this worker's alone ([`CacheDir`]): mode 0700, locked while the tier is
//! open (a second worker on it is refused), files 0600 created with O_EXCL|O_NOFOLLOW under
//! random temporary names; chunk files are opened without following symlinks.

use crate::cpu_tier::KeyMap;
use crate::hash::hash_bytes;
use crate::key::{ChunkKey, FORMAT_VERSION};
use kvconnect_cache_dir::{sync_file, CacheDir, CacheDirError};
use kvconnect_support::stable_hash::{checksum, Checksum};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

const MAGIC: [u8; 8] = *b"KVCLMCHK";
/// Bytes before the chunk's data.
pub const HEADER_LEN: usize = 64;
/// Bytes after the chunk's data (its checksum).
pub const TRAILER_LEN: usize = 16;
/// Bytes a file holds besides the chunk's data.
pub const FILE_OVERHEAD: usize = HEADER_LEN + TRAILER_LEN;
/// Bytes hashed and written (or read and hashed) at a time: small enough to stay in the L2
/// cache between the two, large enough that the calls cost little (256 KiB pieces measured
/// 6% slower over an 8 MiB chunk).
const PIECE: usize = 1 << 20;
const HEADER_SEED: [u64; 2] = [0x6c6d_6361_6368_6521, 0x6469_736b_2d74_6965];

/// Why the tier cannot open.
#[derive(Debug, thiserror::Error)]
pub enum DiskOpenError {
    /// The directory cannot be made this worker's.
    #[error(transparent)]
    Dir(#[from] CacheDirError),
    /// Its files cannot be listed.
    #[error("local_disk '{path}' cannot be used: {source}; point local_disk at a writable directory")]
    Io {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Why a chunk could not be written.
#[derive(Debug, thiserror::Error)]
pub enum DiskWriteError {
    /// The chunk alone is larger than the tier's budget.
    #[error("chunk of {len} bytes does not fit the disk budget of {budget} bytes (max_local_disk_size)")]
    TooLarge {
        /// Chunk bytes with header.
        len: u64,
        /// Budget.
        budget: u64,
    },
    /// The file system refused.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Why a stored chunk could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiskReadError {
    /// The file failed its checks (and was removed).
    #[error("disk chunk {path} is corrupt: {reason}; it was removed")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What check failed.
        reason: String,
    },
}

/// A checked chunk record (a disk file or a remote value): header, data, checksum trailer.
pub struct DiskChunk {
    buf: Vec<u8>,
}

impl DiskChunk {
    /// The chunk's bytes.
    pub fn data(&self) -> &[u8] {
        &self.buf[HEADER_LEN..self.buf.len() - TRAILER_LEN]
    }
}

/// The record of a chunk, as a disk file holds it and the remote tier stores it: the header
/// (magic, format, key, length), the bytes, their checksum.
pub fn encode_record(key: ChunkKey, data: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(FILE_OVERHEAD + data.len());
    buf.extend_from_slice(&record_header(key, data.len()));
    let mut h = Checksum::new();
    for piece in data.chunks(PIECE) {
        h.update(piece);
        buf.extend_from_slice(piece);
    }
    buf.extend_from_slice(&trailer(h.finish(), data.len()));
    buf
}

/// Checks a whole record of `key` (header, length, checksum): the chunk, or what is wrong.
pub fn check_record(key: ChunkKey, buf: Vec<u8>) -> Result<DiskChunk, String> {
    let len = parse_header(&buf, key)?;
    if record_len(len)? != buf.len() as u64 {
        return Err(format!("record is {} bytes, header says {} of data", buf.len(), len));
    }
    let data_end = buf.len() - TRAILER_LEN;
    let sum = checksum(&buf[HEADER_LEN..data_end]);
    if trailer(sum, data_end - HEADER_LEN) != buf[data_end..] {
        return Err("data checksum mismatch".to_owned());
    }
    Ok(DiskChunk { buf })
}

/// The trailer of `len` bytes of data whose checksum is `sum`: the checksum, then the
/// length again.
fn trailer(sum: u64, len: usize) -> [u8; TRAILER_LEN] {
    let mut t = [0u8; TRAILER_LEN];
    t[..8].copy_from_slice(&sum.to_le_bytes());
    t[8..].copy_from_slice(&(len as u64).to_le_bytes());
    t
}

struct Entry {
    file_len: u64,
    tick: u64,
}

struct Index {
    map: KeyMap<Entry>,
    lru: BTreeMap<u64, ChunkKey>,
    used: u64,
    tick: u64,
}

impl Index {
    fn insert(&mut self, key: ChunkKey, file_len: u64) {
        self.remove(&key);
        self.tick += 1;
        self.lru.insert(self.tick, key);
        self.map.insert(key, Entry { file_len, tick: self.tick });
        self.used += file_len;
    }

    fn remove(&mut self, key: &ChunkKey) -> bool {
        match self.map.remove(key) {
            Some(e) => {
                self.lru.remove(&e.tick);
                self.used -= e.file_len;
                true
            }
            None => false,
        }
    }

    fn touch(&mut self, key: &ChunkKey) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.map.get_mut(key) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, *key);
        }
    }
}

/// The disk tier of one store.
pub struct DiskTier {
    dir: CacheDir,
    budget: u64,
    index: Mutex<Index>,
}

/// What opening found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OpenReport {
    /// Chunks indexed.
    pub chunks: usize,
    /// Files removed because their header was wrong or they were unfinished writes.
    pub removed: usize,
}

impl DiskTier {
    /// Opens (creating if needed) the tier in `dir` with a budget in bytes, takes the
    /// directory for this worker (see the module doc), and indexes the chunks already there.
    pub fn open(dir: &Path, budget: u64) -> Result<(DiskTier, OpenReport), DiskOpenError> {
        let cache_dir = CacheDir::open(dir, "local_disk")?;
        let io = |source| DiskOpenError::Io { path: dir.to_owned(), source };
        let mut found: Vec<(SystemTime, ChunkKey, u64)> = Vec::new();
        let mut report = OpenReport::default();
        for ent in std::fs::read_dir(dir).map_err(io)? {
            let ent = ent.map_err(io)?;
            let name = ent.file_name().to_string_lossy().into_owned();
            let path = ent.path();
            if name.contains(".tmp-") {
                // An unfinished write of a process that died (this one holds the lock).
                let _ = std::fs::remove_file(&path);
                report.removed += 1;
                continue;
            }
            let Some(key) = name.strip_suffix(".chunk").and_then(ChunkKey::from_hex) else { continue };
            match check_header_file(&path, key) {
                Ok(len) => {
                    let mtime = ent.metadata().and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
                    found.push((mtime, key, len));
                }
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                    report.removed += 1;
                }
            }
        }
        found.sort();
        let mut index = Index { map: KeyMap::default(), lru: BTreeMap::new(), used: 0, tick: 0 };
        for (_, key, len) in found {
            index.insert(key, len);
        }
        let tier = DiskTier { dir: cache_dir, budget, index: Mutex::new(index) };
        tier.evict_until(0);
        report.chunks = tier.lock().map.len();
        Ok((tier, report))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        match self.index.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The file of a chunk.
    pub fn path_of(&self, key: &ChunkKey) -> PathBuf {
        self.dir.path().join(format!("{}.chunk", key.hex()))
    }

    /// True when the chunk is indexed.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.lock().map.contains_key(key)
    }

    /// Every chunk indexed.
    pub fn keys(&self) -> Vec<ChunkKey> {
        self.lock().map.keys().copied().collect()
    }

    /// (chunks, bytes used, budget).
    pub fn usage(&self) -> (u64, u64, u64) {
        let i = self.lock();
        (i.map.len() as u64, i.used, self.budget)
    }

    /// Removes every chunk and its file; returns their keys.
    pub fn clear(&self) -> Vec<ChunkKey> {
        let keys: Vec<ChunkKey> = {
            let mut i = self.lock();
            i.lru.clear();
            i.used = 0;
            i.map.drain().map(|(k, _)| k).collect()
        };
        for k in &keys {
            let _ = std::fs::remove_file(self.path_of(k));
        }
        keys
    }

    /// Removes least recently used chunks until `incoming` more bytes fit; returns how many.
    fn evict_until(&self, incoming: u64) -> Vec<ChunkKey> {
        let mut gone = Vec::new();
        loop {
            let victim = {
                let mut i = self.lock();
                if i.used + incoming <= self.budget {
                    return gone;
                }
                let Some((_, k)) = i.lru.pop_first() else { return gone };
                if let Some(e) = i.map.remove(&k) {
                    i.used -= e.file_len;
                }
                k
            };
            let _ = std::fs::remove_file(self.path_of(&victim));
            gone.push(victim);
        }
    }

    /// Writes a chunk (blocking; the store calls it from its writer thread). Returns whether
    /// it was written (false: already there) and the chunks evicted to make room.
    pub fn write(&self, key: ChunkKey, data: &[u8]) -> Result<(bool, Vec<ChunkKey>), DiskWriteError> {
        let file_len = (FILE_OVERHEAD + data.len()) as u64;
        if file_len > self.budget {
            return Err(DiskWriteError::TooLarge { len: file_len, budget: self.budget });
        }
        if self.contains(&key) {
            return Ok((false, Vec::new()));
        }
        let evicted = self.evict_until(file_len);
        let path = self.path_of(&key);
        let io = |source| DiskWriteError::Io { path: path.clone(), source };
        let (tmp, mut f) = self.dir.create_temp(&key.hex()).map_err(io)?;
        let header = record_header(key, data.len());
        let res = (|| {
            f.write_all(&header)?;
            let mut h = Checksum::new();
            for piece in data.chunks(PIECE) {
                h.update(piece);
                f.write_all(piece)?;
            }
            f.write_all(&trailer(h.finish(), data.len()))?;
            sync_file(&f)?;
            // rename(2) replaces whatever is at the final name (a symlink too) without
            // following it.
            std::fs::rename(&tmp, &path)?;
            self.dir.sync()
        })();
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        self.lock().insert(key, file_len);
        Ok((true, evicted))
    }

    /// Reads and checks a chunk. `Ok(None)`: not here. A corrupt file is removed and reported.
    pub fn read(&self, key: &ChunkKey) -> Result<Option<DiskChunk>, DiskReadError> {
        let Some(expected_len) = self.lock().map.get(key).map(|e| e.file_len) else { return Ok(None) };
        let path = self.path_of(key);
        let result = read_checked(&path, *key, expected_len);
        match result {
            Ok(buf) => {
                self.lock().touch(key);
                Ok(Some(DiskChunk { buf }))
            }
            Err(reason) => {
                self.lock().remove(key);
                let _ = std::fs::remove_file(&path);
                Err(DiskReadError::Corrupt { path, reason })
            }
        }
    }
}

/// The whole record's length for a header's data length, which a file or the remote tier
/// supplies: checked, never wrapped.
fn record_len(data_len: u64) -> Result<u64, String> {
    data_len
        .checked_add(FILE_OVERHEAD as u64)
        .ok_or_else(|| format!("header says {data_len} bytes of data, more than any record can hold"))
}

/// The header of a record of `len` bytes of `key`'s data, with its checksum.
pub fn record_header(key: ChunkKey, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&key.0[0].to_le_bytes());
    h[24..32].copy_from_slice(&key.0[1].to_le_bytes());
    h[32..40].copy_from_slice(&(len as u64).to_le_bytes());
    let hsum = hash_bytes(HEADER_SEED, &h[..56]);
    h[56..64].copy_from_slice(&hsum[0].to_le_bytes());
    h
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Checks a header; returns the data length.
fn parse_header(h: &[u8], key: ChunkKey) -> Result<u64, String> {
    if h.len() < HEADER_LEN {
        return Err(format!("file is {} bytes, shorter than its header", h.len()));
    }
    if h[0..8] != MAGIC {
        return Err("bad magic".to_owned());
    }
    if hash_bytes(HEADER_SEED, &h[..56])[0] != u64_at(h, 56) {
        return Err("header checksum mismatch".to_owned());
    }
    let mut v = [0u8; 4];
    v.copy_from_slice(&h[8..12]);
    let version = u32::from_le_bytes(v);
    if version != FORMAT_VERSION {
        return Err(format!("store format {version}, this build reads {FORMAT_VERSION}"));
    }
    if ChunkKey([u64_at(h, 16), u64_at(h, 24)]) != key {
        return Err("header names another key than the file name".to_owned());
    }
    Ok(u64_at(h, 32))
}

/// Opens a chunk file for reading; a symlink in its place is an error, never followed.
fn open_chunk(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// Checks a file's header and length without reading its data; returns the file length.
fn check_header_file(path: &Path, key: ChunkKey) -> Result<u64, String> {
    let mut f = open_chunk(path).map_err(|e| e.to_string())?;
    let mut h = [0u8; HEADER_LEN];
    f.read_exact(&mut h).map_err(|e| format!("cannot read header: {e}"))?;
    let len = parse_header(&h, key)?;
    let file_len = f.metadata().map_err(|e| e.to_string())?.len();
    if file_len != record_len(len)? {
        return Err(format!("file is {file_len} bytes, header says {len} of data"));
    }
    Ok(file_len)
}

fn read_checked(path: &Path, key: ChunkKey, expected_len: u64) -> Result<Vec<u8>, String> {
    let mut f = open_chunk(path).map_err(|e| format!("cannot open: {e}"))?;
    let file_len = f.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
    if file_len != expected_len || file_len < FILE_OVERHEAD as u64 {
        return Err(format!("file is {file_len} bytes, {expected_len} were written"));
    }
    // Zeroed by allocation (fresh zero pages for a chunk-sized buffer, no pass over it).
    let mut buf = vec![0u8; file_len as usize];
    let early = |what: &'static str| {
        move |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => format!("file ended early in the {what}"),
            _ => format!("cannot read {what}: {e}"),
        }
    };
    f.read_exact(&mut buf[..HEADER_LEN]).map_err(early("header"))?;
    let len = parse_header(&buf[..HEADER_LEN], key)?;
    if record_len(len)? != file_len {
        return Err(format!("file is {file_len} bytes, header says {len} of data"));
    }
    let data_end = file_len as usize - TRAILER_LEN;
    let mut h = Checksum::new();
    // Each piece read straight into its place in one call and hashed there while it is in
    // cache, so the data crosses memory once, as a plain read's does.
    for piece in buf[HEADER_LEN..data_end].chunks_mut(PIECE) {
        f.read_exact(piece).map_err(early("data"))?;
        h.update(piece);
    }
    f.read_exact(&mut buf[data_end..]).map_err(early("trailer"))?;
    if trailer(h.finish(), data_end - HEADER_LEN) != buf[data_end..] {
        return Err("data checksum mismatch".to_owned());
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_restart_corrupt_and_budget() {
        let dir = tempfile::tempdir().unwrap();
        let (t, r) = DiskTier::open(dir.path(), 10_000).unwrap();
        assert_eq!(r.chunks, 0);
        let a = ChunkKey([1, 2]);
        let b = ChunkKey([3, 4]);
        t.write(a, &[7u8; 1000]).unwrap();
        t.write(b, &[9u8; 1000]).unwrap();
        assert_eq!(t.read(&a).unwrap().unwrap().data(), &[7u8; 1000][..]);
        drop(t);
        let (t, r) = DiskTier::open(dir.path(), 10_000).unwrap();
        assert_eq!(r.chunks, 2, "the index survives a restart");
        // Flip one data byte: a miss, and the file is gone.
        let p = t.path_of(&b);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[HEADER_LEN + 500] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let e = t.read(&b).err().unwrap().to_string();
        assert!(e.contains("data checksum mismatch"), "{e}");
        assert!(!p.exists() && !t.contains(&b));
        // Truncated: also a miss.
        let p = t.path_of(&a);
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 10]).unwrap();
        assert!(t.read(&a).is_err());
        // Budget: 10_000 bytes hold nine 1080-byte files, not ten.
        for i in 0..10u64 {
            t.write(ChunkKey([100 + i, 0]), &[i as u8; 1000]).unwrap();
        }
        assert_eq!(t.usage().0, 9);
        assert!(!t.contains(&ChunkKey([100, 0])), "oldest evicted");
        assert!(matches!(t.write(ChunkKey([5, 5]), &[0u8; 20_000]), Err(DiskWriteError::TooLarge { .. })));
    }

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_directory_and_chunk_files_are_private() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("disk");
        let (t, _) = DiskTier::open(&dir, 10_000).unwrap();
        t.write(ChunkKey([1, 2]), &[7u8; 100]).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&t.path_of(&ChunkKey([1, 2]))), 0o600);
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| n == ".lock" || n.ends_with(".chunk")), "{names:?}");
    }

    #[test]
    fn symlinks_at_a_chunk_path_are_neither_followed_nor_served() {
        use std::os::unix::fs::symlink;
        let root = tempfile::tempdir().unwrap();
        let victim = root.path().join("victim");
        std::fs::write(&victim, b"someone else's file").unwrap();
        let dir = root.path().join("disk");
        let key = ChunkKey([5, 6]);
        {
            let (t, _) = DiskTier::open(&dir, 10_000).unwrap();
            // Planted at the path a write goes to: replaced, not written through.
            symlink(&victim, t.path_of(&key)).unwrap();
            t.write(key, &[1u8; 64]).unwrap();
            assert!(!t.path_of(&key).symlink_metadata().unwrap().file_type().is_symlink());
            assert_eq!(t.read(&key).unwrap().unwrap().data(), &[1u8; 64][..]);
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"someone else's file");
        // Planted in place of a chunk while no worker ran, pointing at a valid record: not
        // indexed (the link is removed, its target kept).
        let good = root.path().join("good");
        std::fs::write(&good, encode_record(ChunkKey([9, 9]), &[3u8; 10])).unwrap();
        symlink(&good, dir.join(format!("{}.chunk", ChunkKey([9, 9]).hex()))).unwrap();
        let (t, r) = DiskTier::open(&dir, 10_000).unwrap();
        assert_eq!((r.chunks, r.removed), (1, 1));
        assert!(!t.contains(&ChunkKey([9, 9])) && good.exists());
    }

    #[test]
    fn a_second_tier_on_the_same_directory_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let (_t, _) = DiskTier::open(root.path(), 10_000).unwrap();
        let e = DiskTier::open(root.path(), 10_000).err().unwrap().to_string();
        assert!(e.contains("is in use by another worker (pid") && e.contains("its own local_disk"), "{e}");
    }

    #[test]
    fn a_sealed_header_with_a_huge_length_is_refused_not_wrapped() {
        // A remote tier's value is written by whoever reaches the store: its header checksum
        // is no proof of a sane length.
        let key = ChunkKey([7, 8]);
        for len in [usize::MAX, usize::MAX - FILE_OVERHEAD + 1, usize::MAX - 100] {
            let mut rec = record_header(key, len).to_vec();
            rec.extend_from_slice(&[0u8; TRAILER_LEN]);
            let e = check_record(key, rec).err().unwrap();
            assert!(e.contains("header says"), "{len}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(format!("{}.chunk", key.hex()));
        std::fs::write(&p, record_header(key, usize::MAX)).unwrap();
        assert!(check_header_file(&p, key).unwrap_err().contains("more than any record"));
    }
}

//! The chunk store of one engine: the CPU tier in front, the disk tier behind it, and the
//! remote tier (a Redis server other workers share) behind both.
//!
//! What the CPU tier evicts goes to a background writer thread, so a save costs the step loop
//! only its copy out of the KV cache. Until the writer has finished a chunk it stays
//! readable from an in-flight map, so a chunk is never missing between the two tiers. Every
//! new chunk is also handed to the remote tier's writer thread; a chunk read from the remote
//! is kept in the CPU tier, so the next hit is local.

use crate::chunk_buf::ChunkBuf;
use crate::config::LmcacheConfig;
use crate::cpu_tier::{ChunkData, CpuTier, KeyMap};
use crate::disk_tier::{DiskChunk, DiskTier, FILE_OVERHEAD};
use crate::key::{ChunkKey, ChunkRef};
use crate::remote_tier::{RemoteRead, RemoteTier};
use crate::remote_watch::RemoteChange;
use crate::stats::{add, Counters, LmcacheStats};
use kvconnect_api::{ConnectorError, KvEvent, Medium};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Events kept for `take_events` at most; older ones are dropped.
const MAX_EVENTS: usize = 65_536;

/// Bytes of a chunk read out of a tier.
pub enum ChunkBytes {
    /// From host memory (the CPU tier or the writer's queue).
    Mem(ChunkData),
    /// From a disk file, checked.
    Disk(DiskChunk),
}

/// The tier a chunk was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Host memory.
    Cpu,
    /// The local disk (or the disk writer's queue).
    Disk,
    /// The remote (Redis).
    Remote,
}

impl Tier {
    /// `cpu`, `disk` or `remote`, as metrics and reports name it.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }
}

impl ChunkBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            ChunkBytes::Mem(d) => d.as_slice(),
            ChunkBytes::Disk(d) => d.data(),
        }
    }
}

enum Job {
    Write(ChunkKey, ChunkData),
    Flush(mpsc::Sender<()>),
}

struct Shared {
    disk: Option<DiskTier>,
    pool: Mutex<BufferPool>,
    inflight: Mutex<KeyMap<ChunkData>>,
    inflight_bytes: AtomicU64,
    counters: Arc<Counters>,
    events: Mutex<VecDeque<KvEvent>>,
    /// What KV events say of a chunk besides its hash: its tokens and the chunk before it.
    meta: Mutex<KeyMap<ChunkMeta>>,
}

/// A chunk's tokens and parent, as the scheduler half saw them.
#[derive(Clone)]
struct ChunkMeta {
    parent: Option<u64>,
    tokens: Arc<[u32]>,
}

/// Chunk descriptions kept at most before those of chunks no local tier holds are dropped.
const MAX_META: usize = 1 << 18;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Buffers of chunks that left every tier, kept for the next saves: a fresh multi-megabyte
/// allocation is mapped page by page on first write, which costs more than the copy itself.
struct BufferPool {
    bufs: Vec<Vec<u8>>,
    bytes: u64,
    cap: u64,
}

impl BufferPool {
    fn take(&mut self, len: usize) -> Option<Vec<u8>> {
        // A buffer at least as large, but not wastefully larger.
        let i =
            self.bufs.iter().position(|b| b.capacity() >= len && b.capacity() <= len.saturating_mul(2))?;
        let mut b = self.bufs.swap_remove(i);
        self.bytes -= b.capacity() as u64;
        b.clear();
        Some(b)
    }

    fn give(&mut self, data: ChunkData) {
        // Pinned slots go back to their slab when dropped; heap buffers are kept.
        if let Ok(ChunkBuf::Heap(v)) = Arc::try_unwrap(data) {
            if self.bytes + v.capacity() as u64 <= self.cap {
                self.bytes += v.capacity() as u64;
                self.bufs.push(v);
            }
        }
    }
}

impl Shared {
    fn recycle(&self, data: ChunkData) {
        lock(&self.pool).give(data);
    }

    /// The store of one chunk in `medium`: its hash, the previous chunk's, its tokens (one
    /// event block per chunk, the chunk's length as the block size); a chunk never described
    /// is published with its hash alone.
    fn stored_event(&self, key: ChunkKey, medium: Medium) -> KvEvent {
        match lock(&self.meta).get(&key).cloned() {
            Some(m) => {
                KvEvent::stored(vec![key.0[0]], m.parent, m.tokens.to_vec(), m.tokens.len() as u32, medium)
            }
            None => KvEvent::stored(vec![key.0[0]], None, Vec::new(), 0, medium),
        }
    }

    fn event(&self, e: KvEvent) {
        let mut q = lock(&self.events);
        if q.len() >= MAX_EVENTS {
            q.pop_front();
        }
        q.push_back(e);
    }
}

/// One engine's chunk store (shared by its scheduler and worker halves).
pub struct ChunkStore {
    cpu: Option<Mutex<CpuTier>>,
    remote: Option<RemoteTier>,
    shared: Arc<Shared>,
    tx: Option<Mutex<mpsc::Sender<Job>>>,
    writer: Option<JoinHandle<()>>,
    queue_cap: u64,
}

impl ChunkStore {
    /// Opens the tiers the config names. The disk directory is created and must be writable.
    pub fn open(cfg: &LmcacheConfig) -> Result<ChunkStore, ConnectorError> {
        let cpu = cfg.local_cpu.then(|| Mutex::new(CpuTier::new(cfg.cpu_budget_bytes())));
        let disk = match &cfg.local_disk {
            None => None,
            Some(dir) => {
                let (tier, report) = DiskTier::open(dir, cfg.disk_budget_bytes())
                    .map_err(|e| ConnectorError::config("lmcache", e.to_string()))?;
                if report.removed > 0 {
                    tracing::warn!(dir = %dir.display(), removed = report.removed, "lmcache: removed \
                        unreadable or unfinished chunk files from the disk tier");
                }
                tracing::info!(dir = %dir.display(), chunks = report.chunks, "lmcache: disk tier opened");
                Some(tier)
            }
        };
        let has_disk = disk.is_some();
        // Freed buffers kept for reuse: an eighth of the CPU budget, at least 64 MiB, never
        // more than the budget itself (64 MiB without a CPU tier).
        let budget = cfg.cpu_budget_bytes();
        let pool_cap = if cfg.local_cpu { (budget / 8).max(64 << 20).min(budget) } else { 64 << 20 };
        let counters = Arc::new(Counters::default());
        let remote = match &cfg.remote {
            None => None,
            Some(r) => {
                let tier = RemoteTier::with_counters(r, counters.clone())
                    .map_err(|e| ConnectorError::config("lmcache", e.to_string()))?;
                tracing::info!(url = %r.url, timeout_ms = r.timeout_ms, "lmcache: remote tier set up");
                Some(tier)
            }
        };
        let shared = Arc::new(Shared {
            disk,
            pool: Mutex::new(BufferPool { bufs: Vec::new(), bytes: 0, cap: pool_cap }),
            inflight: Mutex::new(KeyMap::default()),
            inflight_bytes: AtomicU64::new(0),
            counters,
            events: Mutex::new(VecDeque::new()),
            meta: Mutex::new(KeyMap::default()),
        });
        let (tx, writer) = if has_disk {
            let (tx, rx) = mpsc::channel::<Job>();
            let sh = shared.clone();
            let h = std::thread::Builder::new()
                .name("lmcache-disk-writer".to_owned())
                .spawn(move || writer_loop(&sh, rx))
                .map_err(|e| {
                    ConnectorError::io("lmcache", format!("cannot start the disk writer thread: {e}"))
                })?;
            (Some(Mutex::new(tx)), Some(h))
        } else {
            (None, None)
        };
        // The writer's queue may hold as much as the CPU tier (at least 256 MiB) before
        // evictions are dropped instead of queued: memory stays bounded if the disk is slow.
        let queue_cap = cfg.cpu_budget_bytes().max(256 << 20);
        Ok(ChunkStore { cpu, remote, shared, tx, writer, queue_cap })
    }

    /// True when a local tier (CPU or disk) holds the chunk. No side effects (LRU order and
    /// stats unchanged).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        if let Some(cpu) = &self.cpu {
            if lock(cpu).contains(key) {
                return true;
            }
        }
        if self.shared.disk.is_none() {
            return false;
        }
        if lock(&self.shared.inflight).contains_key(key) {
            return true;
        }
        self.shared.disk.as_ref().is_some_and(|d| d.contains(key))
    }

    /// How many of `keys`, from the first, some tier holds (one lock for the CPU tier's run,
    /// one round trip to the remote for the rest). No side effects on the local tiers.
    pub fn stored_prefix(&self, keys: impl Iterator<Item = ChunkKey> + Clone) -> usize {
        let mut n = 0;
        if let Some(cpu) = &self.cpu {
            let cpu = lock(cpu);
            n = keys.clone().take_while(|k| cpu.contains(k)).count();
        }
        n += keys.clone().skip(n).take_while(|k| self.contains(k)).count();
        match &self.remote {
            Some(remote) => {
                let rest: Vec<ChunkKey> = keys.skip(n).collect();
                n + remote.stored_prefix(&rest)
            }
            None => n,
        }
    }

    /// Stores a chunk in the CPU tier (or, without one or when it does not fit, hands it to
    /// the disk writer).
    pub fn put(&self, key: ChunkKey, data: impl Into<ChunkBuf>) {
        let data = Arc::new(data.into());
        let len = data.len() as u64;
        let c = &self.shared.counters;
        let to_disk = match &self.cpu {
            Some(cpu) => {
                let mut cpu = lock(cpu);
                if cpu.contains(&key) {
                    return;
                }
                let for_remote = self.remote.as_ref().map(|_| data.clone());
                match cpu.put(key, data) {
                    Ok(evicted) => {
                        if let (Some(remote), Some(d)) = (&self.remote, for_remote) {
                            remote.put(key, d);
                        }
                        add(&c.chunks_saved, 1);
                        add(&c.cpu.bytes_stored, len);
                        self.shared.event(self.shared.stored_event(key, Medium::CpuTier));
                        for (k, d) in evicted {
                            add(&c.cpu.evictions, 1);
                            self.shared.event(KvEvent::removed(vec![k.0[0]], Medium::CpuTier));
                            // Still under the CPU lock, so the chunk is never in neither place.
                            self.send_to_disk(k, d);
                        }
                        return;
                    }
                    Err(data) => data,
                }
            }
            None => data,
        };
        if self.shared.disk.is_some() || self.remote.is_some() {
            add(&c.chunks_saved, 1);
            if let Some(remote) = &self.remote {
                remote.put(key, to_disk.clone());
            }
            self.send_to_disk(key, to_disk);
        } else {
            add(&c.rejected_chunks, 1);
            tracing::warn!(
                bytes = len,
                "lmcache: chunk larger than max_local_cpu_size and no disk tier; not stored"
            );
        }
    }

    /// Evicts least recently used chunks from the CPU tier (to the disk tier, as `put`
    /// would) until `bytes` more fit, so a save about to take pinned slots finds the slots
    /// of what `put` would evict anyway already free. No CPU tier: nothing to do.
    pub fn make_room(&self, bytes: u64) {
        let Some(cpu) = &self.cpu else { return };
        let c = &self.shared.counters;
        let mut cpu = lock(cpu);
        for (k, d) in cpu.evict_for(bytes) {
            add(&c.cpu.evictions, 1);
            self.shared.event(KvEvent::removed(vec![k.0[0]], Medium::CpuTier));
            self.send_to_disk(k, d);
        }
    }

    /// The CPU tier's budget in bytes (0 without a CPU tier).
    pub fn cpu_budget(&self) -> u64 {
        self.cpu.as_ref().map_or(0, |c| lock(c).budget())
    }

    /// Counts chunks a device save gathered straight into pinned slots, and chunks it had
    /// to build on the heap because the pinned slab had no free slot.
    pub fn count_pinned(&self, pinned: usize, fallback: usize) {
        add(&self.shared.counters.pinned_chunks_saved, pinned as u64);
        add(&self.shared.counters.pinned_fallback_chunks, fallback as u64);
    }

    /// An empty buffer with room for `len` bytes, reused when one is free.
    pub fn take_buffer(&self, len: usize) -> Vec<u8> {
        lock(&self.shared.pool).take(len).unwrap_or_else(|| Vec::with_capacity(len))
    }

    fn send_to_disk(&self, key: ChunkKey, data: ChunkData) {
        let Some(tx) = &self.tx else {
            self.shared.recycle(data);
            return;
        };
        let c = &self.shared.counters;
        let len = data.len() as u64;
        if self.shared.inflight_bytes.load(Ordering::Relaxed) + len > self.queue_cap {
            add(&c.disk_queue_drops, 1);
            self.shared.recycle(data);
            return;
        }
        {
            let mut q = lock(&self.shared.inflight);
            if q.insert(key, data.clone()).is_none() {
                self.shared.inflight_bytes.fetch_add(len, Ordering::Relaxed);
            }
        }
        if lock(tx).send(Job::Write(key, data)).is_err() {
            // The writer is gone (it only stops when the store drops): keep nothing queued.
            if lock(&self.shared.inflight).remove(&key).is_some() {
                self.shared.inflight_bytes.fetch_sub(len, Ordering::Relaxed);
            }
            add(&c.disk_write_errors, 1);
        }
    }

    /// The chunk from the fastest tier holding it. A corrupt disk chunk is removed and
    /// counted, and the answer is `None`.
    pub fn get(&self, key: &ChunkKey) -> Option<(ChunkBytes, Tier)> {
        let c = &self.shared.counters;
        if let Some(cpu) = &self.cpu {
            if let Some(d) = lock(cpu).get(key) {
                add(&c.cpu.hits, 1);
                add(&c.cpu.bytes_loaded, d.len() as u64);
                return Some((ChunkBytes::Mem(d), Tier::Cpu));
            }
        }
        if let Some(b) = self.get_disk(key) {
            return Some((b, Tier::Disk));
        }
        let remote = self.remote.as_ref()?;
        match remote.get(key) {
            RemoteRead::Hit(chunk) => {
                let data: ChunkData = Arc::new(ChunkBuf::Record(chunk));
                self.keep_in_cpu(*key, data.clone());
                Some((ChunkBytes::Mem(data), Tier::Remote))
            }
            RemoteRead::Miss | RemoteRead::Corrupt(_) => None,
        }
    }

    /// A chunk read from the remote goes into the CPU tier (its evictions to disk as usual),
    /// not back to the remote.
    fn keep_in_cpu(&self, key: ChunkKey, data: ChunkData) {
        let Some(cpu) = &self.cpu else { return };
        let c = &self.shared.counters;
        let mut cpu = lock(cpu);
        if cpu.contains(&key) {
            return;
        }
        if let Ok(evicted) = cpu.put(key, data) {
            self.shared.event(self.shared.stored_event(key, Medium::CpuTier));
            for (k, d) in evicted {
                add(&c.cpu.evictions, 1);
                self.shared.event(KvEvent::removed(vec![k.0[0]], Medium::CpuTier));
                self.send_to_disk(k, d);
            }
        }
    }

    fn get_disk(&self, key: &ChunkKey) -> Option<ChunkBytes> {
        let c = &self.shared.counters;
        let disk = self.shared.disk.as_ref()?;
        if let Some(d) = lock(&self.shared.inflight).get(key).cloned() {
            // Still on its way to disk: served from memory, counted as a disk-tier hit.
            add(&c.disk.hits, 1);
            add(&c.disk.bytes_loaded, d.len() as u64);
            return Some(ChunkBytes::Mem(d));
        }
        match disk.read(key) {
            Ok(Some(d)) => {
                add(&c.disk.hits, 1);
                add(&c.disk.bytes_loaded, d.data().len() as u64);
                Some(ChunkBytes::Disk(d))
            }
            Ok(None) => None,
            Err(e) => {
                add(&c.disk_corrupt_chunks, 1);
                self.shared.event(KvEvent::removed(vec![key.0[0]], Medium::Disk));
                tracing::warn!("lmcache: {e}");
                None
            }
        }
    }

    /// Counts a chunk a load needed and did not get.
    pub fn count_miss(&self) {
        add(&self.shared.counters.misses, 1);
    }

    /// Counts tokens promised to a load.
    pub fn count_hit_tokens(&self, n: usize) {
        add(&self.shared.counters.hit_tokens, n as u64);
    }

    /// Counts blocks reported as failed loads.
    pub fn count_load_error_blocks(&self, n: usize) {
        add(&self.shared.counters.load_error_blocks, n as u64);
    }

    /// Counts a save that failed.
    pub fn count_save_error(&self) {
        add(&self.shared.counters.save_errors, 1);
    }

    /// Waits until every chunk handed to the disk and remote writers so far is written (or
    /// failed).
    pub fn flush(&self) {
        if let Some(remote) = &self.remote {
            remote.flush();
        }
        let Some(tx) = &self.tx else { return };
        let (done_tx, done_rx) = mpsc::channel();
        if lock(tx).send(Job::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }

    /// Empties the local tiers (vLLM's `/reset_prefix_cache?reset_external=true`): the
    /// chunks still queued for the disk are written first, then every CPU and disk chunk is
    /// removed, each as a `Removed` event. A remote tier is shared with other engines and is
    /// left as it is. Returns how many chunks were removed.
    pub fn clear(&self) -> usize {
        self.flush();
        lock(&self.shared.meta).clear();
        let mut n = 0;
        if let Some(cpu) = &self.cpu {
            let keys = lock(cpu).clear();
            n += keys.len();
            if !keys.is_empty() {
                self.shared.event(KvEvent::removed(keys.iter().map(|k| k.0[0]).collect(), Medium::CpuTier));
            }
        }
        if let Some(disk) = &self.shared.disk {
            let keys = disk.clear();
            n += keys.len();
            if !keys.is_empty() {
                self.shared.event(KvEvent::removed(keys.iter().map(|k| k.0[0]).collect(), Medium::Disk));
            }
        }
        n
    }

    /// Events since the last call: the local tiers' in order, then the remote's: the chunks
    /// its writer wrote and those the server removed, in the order seen
    /// ([`crate::remote_watch`]).
    pub fn take_events(&self) -> Vec<KvEvent> {
        let mut out: Vec<KvEvent> = lock(&self.shared.events).drain(..).collect();
        if let Some(remote) = &self.remote {
            out.extend(remote.take_changes().into_iter().map(|c| match c {
                RemoteChange::Written(k) => self.shared.stored_event(k, Medium::Remote),
                RemoteChange::Removed(k) => KvEvent::removed(vec![k.0[0]], Medium::Remote),
            }));
        }
        out
    }

    /// The hashes (as KV events name them) each local tier holds now, after the queued disk
    /// writes: `(cpu_tier, disk)`. For checking the event stream against the contents.
    pub fn holdings(&self) -> (Vec<u64>, Vec<u64>) {
        self.flush();
        let cpu = self.cpu.as_ref().map(|c| lock(c).keys()).unwrap_or_default();
        let disk = self.shared.disk.as_ref().map(|d| d.keys()).unwrap_or_default();
        let hashes = |ks: Vec<ChunkKey>| ks.into_iter().map(|k| k.0[0]).collect();
        (hashes(cpu), hashes(disk))
    }

    /// Remembers the tokens of a prompt's chunks (`chunks` as [`crate::key::chunk_keys`]
    /// made them from `tokens`), so that their KV events carry them.
    pub fn describe(&self, chunks: &[ChunkRef], tokens: &[u32]) {
        let mut meta = lock(&self.shared.meta);
        if meta.len() >= MAX_META {
            drop(meta);
            let keys: Vec<ChunkKey> = lock(&self.shared.meta).keys().copied().collect();
            let gone: Vec<ChunkKey> = keys.into_iter().filter(|k| !self.contains(k)).collect();
            meta = lock(&self.shared.meta);
            for k in gone {
                meta.remove(&k);
            }
        }
        let mut parent = None;
        for c in chunks {
            let Some(t) = tokens.get(c.start..c.start + c.tokens) else { break };
            meta.entry(c.key).or_insert_with(|| ChunkMeta { parent, tokens: t.into() });
            parent = Some(c.key.0[0]);
        }
    }

    /// A snapshot of the counters and occupancy.
    pub fn stats(&self) -> LmcacheStats {
        let mut s = self.shared.counters.snapshot();
        if let Some(cpu) = &self.cpu {
            let cpu = lock(cpu);
            s.cpu.chunks = cpu.len() as u64;
            s.cpu.bytes_used = cpu.used();
            s.cpu.budget_bytes = cpu.budget();
        }
        if let Some(d) = &self.shared.disk {
            (s.disk.chunks, s.disk.bytes_used, s.disk.budget_bytes) = d.usage();
        }
        s
    }
}

impl Drop for ChunkStore {
    fn drop(&mut self) {
        // Closing the channel ends the writer after it has written what was queued.
        self.tx = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
    }
}

fn writer_loop(sh: &Shared, rx: mpsc::Receiver<Job>) {
    let Some(disk) = &sh.disk else { return };
    let c = &sh.counters;
    while let Ok(job) = rx.recv() {
        match job {
            Job::Flush(done) => {
                let _ = done.send(());
            }
            Job::Write(key, data) => {
                match disk.write(key, &data) {
                    Ok((written, evicted)) => {
                        add(&c.disk.evictions, evicted.len() as u64);
                        if !evicted.is_empty() {
                            sh.event(KvEvent::removed(
                                evicted.iter().map(|k| k.0[0]).collect(),
                                Medium::Disk,
                            ));
                        }
                        if written {
                            add(&c.disk.bytes_stored, (FILE_OVERHEAD + data.len()) as u64);
                            sh.event(sh.stored_event(key, Medium::Disk));
                        }
                    }
                    Err(e) => {
                        let n = c.disk_write_errors.fetch_add(1, Ordering::Relaxed);
                        // The first errors and then every 1000th: a full disk must not flood logs.
                        if n < 5 || n.checked_rem(1000) == Some(0) {
                            tracing::warn!(
                                errors = n + 1,
                                "lmcache: disk tier write failed, chunk dropped: {e}"
                            );
                        }
                    }
                }
                let queued = lock(&sh.inflight).remove(&key);
                if let Some(q) = queued {
                    sh.inflight_bytes.fetch_sub(q.len() as u64, Ordering::Relaxed);
                }
                sh.recycle(data);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clear_empties_the_cpu_and_disk_tiers() {
        let dir = tempfile::tempdir().unwrap();
        // Room for one 800-byte chunk in the CPU tier: the first goes to disk when the second
        // comes.
        let cfg = LmcacheConfig {
            max_local_cpu_size: 1000.0 / 1e9,
            local_disk: Some(dir.path().to_owned()),
            max_local_disk_size: 0.001,
            ..LmcacheConfig::default()
        };
        let store = ChunkStore::open(&cfg).unwrap();
        let (a, b) = (ChunkKey([1, 1]), ChunkKey([2, 2]));
        store.put(a, vec![7u8; 800]);
        store.put(b, vec![8u8; 800]);
        store.flush();
        assert!(store.contains(&a) && store.contains(&b));
        store.take_events();
        assert_eq!(store.clear(), 2);
        assert!(!store.contains(&a) && !store.contains(&b));
        assert!(store.get(&a).is_none() && store.get(&b).is_none());
        let removed: Vec<(Vec<u64>, String)> = store
            .take_events()
            .into_iter()
            .map(|e| match e {
                KvEvent::BlockRemoved(r) => (r.block_hashes, r.medium.to_string()),
                other => panic!("{other:?} on clear"),
            })
            .collect();
        assert_eq!(removed, vec![(vec![2], "cpu_tier".to_owned()), (vec![1], "disk".to_owned())]);
        let files = std::fs::read_dir(dir.path()).unwrap().filter_map(Result::ok);
        assert_eq!(files.filter(|f| f.file_name().to_string_lossy().ends_with(".chunk")).count(), 0);
    }
}

//! The remote tier: chunks shared by workers through one Redis server (`remote_url:
//! redis://host:port`), behind the CPU and disk tiers.
//!
//! **Values.** Each chunk is one Redis string under `kvconnect:lmcache:v<format>:<key>`,
//! holding the same record a disk file holds: a header with the chunk's key and length, the
//! bytes, and their checksum ([`crate::disk_tier::encode_record`]). The key chains from the
//! namespace (model, layout, block size, dtype, TP rank and size, chunk size), so workers with
//! different layouts never read each other's chunks; a value that fails its header, length or
//! checksum check is a miss, counted as corrupt, and is never loaded.
//!
//! **Failures.** Every operation has a timeout (`remote_timeout_ms`, connect, read and write
//! alike). A failed operation is counted, the connection dropped, and the remote is left alone
//! for a back-off (`remote_retry_ms`, doubling with each further failure up to 16 times that,
//! reset by the first success): while it lasts, lookups and loads skip it (counted as misses)
//! and writes are dropped (counted), so a remote that is down costs a request at most one
//! timeout and never fails it.
//!
//! **Writes** go through a background thread with its own connection, so a save never waits
//! on the network; its queue holds at most [`QUEUE_BYTES`], past which chunks are dropped
//! (counted) rather than buffered without bound.
//!
//! **KV events.** The writer records each chunk it wrote, and a watcher thread the chunks the
//! server removed ([`crate::remote_watch`]), in one ordered list the store publishes from.

use crate::config::RemoteConfig;
use crate::disk_tier::{check_record, encode_record, DiskChunk};
use crate::key::{ChunkKey, FORMAT_VERSION};
use crate::remote_watch::{Changes, RemoteChange, Watch};
use crate::stats::{add, Counters};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most bytes waiting for the writer thread.
pub const QUEUE_BYTES: u64 = 512 << 20;

/// Why a remote tier cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The URL does not parse as a Redis URL.
    #[error("remote_url '{url}' is not a Redis URL the client accepts ({reason}); write redis://host:port")]
    BadUrl {
        /// The URL.
        url: String,
        /// The client's reason.
        reason: String,
    },
    /// The writer or watcher thread could not be started.
    #[error("cannot start the remote tier's {0} thread: {1}")]
    Thread(&'static str, std::io::Error),
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Whether the remote may be tried now, shared by readers and the writer.
struct Health {
    failures: u32,
    until: Option<Instant>,
}

pub(crate) struct Link {
    client: redis::Client,
    timeout: Duration,
    pub(crate) retry: Duration,
    health: Mutex<Health>,
    pub(crate) url: String,
}

impl Link {
    /// False while a back-off lasts.
    fn may_try(&self) -> bool {
        lock(&self.health).until.is_none_or(|t| Instant::now() >= t)
    }

    fn succeeded(&self) {
        let mut h = lock(&self.health);
        if h.failures > 0 {
            tracing::info!(url = %self.url, "lmcache: the remote tier answers again");
        }
        h.failures = 0;
        h.until = None;
    }

    fn failed(&self, what: &str, e: &redis::RedisError) {
        let mut h = lock(&self.health);
        h.failures = h.failures.saturating_add(1);
        let backoff = self.retry * (1u32 << (h.failures - 1).min(4));
        h.until = Some(Instant::now() + backoff);
        // The first failures and then every 100th: a remote that stays down must not flood logs.
        if h.failures <= 3 || h.failures.is_multiple_of(100) {
            tracing::warn!(
                url = %self.url,
                failures = h.failures,
                "lmcache: remote tier {what} failed ({e}); treating it as a miss and leaving the remote \
                    alone for {backoff:?}"
            );
        }
    }

    pub(crate) fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let c = self.client.get_connection_with_timeout(self.timeout)?;
        c.set_read_timeout(Some(self.timeout))?;
        c.set_write_timeout(Some(self.timeout))?;
        Ok(c)
    }

    /// Runs `op` on `conn` (connecting first if needed): `None` when the remote is in
    /// back-off or the operation failed (the failure is recorded and the connection dropped).
    /// A kept connection that turns out dropped (the server restarted since its last use) is
    /// replaced once before that counts as a failure.
    fn run<T>(
        &self,
        conn: &mut Option<redis::Connection>,
        what: &str,
        mut op: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, Skip> {
        if !self.may_try() {
            return Err(Skip::Backoff);
        }
        let mut reused = conn.is_some();
        loop {
            if conn.is_none() {
                match self.connect() {
                    Ok(c) => *conn = Some(c),
                    Err(e) => {
                        self.failed(&format!("connect for {what}"), &e);
                        return Err(Skip::Failed);
                    }
                }
            }
            let Some(c) = conn.as_mut() else { return Err(Skip::Failed) };
            match op(c) {
                Ok(v) => {
                    self.succeeded();
                    return Ok(v);
                }
                Err(e) => {
                    *conn = None;
                    if reused && (e.is_connection_dropped() || e.is_io_error()) {
                        reused = false;
                        continue;
                    }
                    self.failed(what, &e);
                    return Err(Skip::Failed);
                }
            }
        }
    }
}

/// Why an operation did not reach the remote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skip {
    /// A back-off after an earlier failure.
    Backoff,
    /// This operation failed.
    Failed,
}

enum Job {
    Write(ChunkKey, crate::cpu_tier::ChunkData),
    Flush(mpsc::Sender<()>),
}

/// What a remote read found.
pub enum RemoteRead {
    /// The chunk, checked.
    Hit(DiskChunk),
    /// Not there, or the remote could not be asked (counted either way).
    Miss,
    /// There, but failed its checks (counted as corrupt); never loaded.
    Corrupt(String),
}

/// The remote tier of one store.
pub struct RemoteTier {
    link: Arc<Link>,
    conn: Mutex<Option<redis::Connection>>,
    counters: Arc<Counters>,
    tx: Option<Mutex<mpsc::Sender<Job>>>,
    writer: Option<JoinHandle<()>>,
    queued: Arc<AtomicU64>,
    /// Chunks written and removed, until the store takes them for its KV events.
    changes: Arc<Changes>,
    /// The thread that hears of removals, and what stops it.
    watcher: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

/// The Redis key of a chunk.
pub fn redis_key(key: &ChunkKey) -> String {
    format!("kvconnect:lmcache:v{FORMAT_VERSION}:{}", key.hex())
}

impl RemoteTier {
    /// Sets the tier up on counters of its own (benchmarks, tools). Nothing is connected yet:
    /// a remote that is down at start is a miss like one that goes down later.
    pub fn open(cfg: &RemoteConfig) -> Result<RemoteTier, RemoteError> {
        RemoteTier::with_counters(cfg, Arc::new(Counters::default()))
    }

    /// Sets the tier up, counting into a store's counters.
    pub(crate) fn with_counters(
        cfg: &RemoteConfig,
        counters: Arc<Counters>,
    ) -> Result<RemoteTier, RemoteError> {
        let client = redis::Client::open(cfg.url.as_str())
            .map_err(|e| RemoteError::BadUrl { url: cfg.url.clone(), reason: e.to_string() })?;
        let link = Arc::new(Link {
            client,
            timeout: Duration::from_millis(cfg.timeout_ms),
            retry: Duration::from_millis(cfg.retry_ms),
            health: Mutex::new(Health { failures: 0, until: None }),
            url: cfg.url.clone(),
        });
        let (tx, rx) = mpsc::channel::<Job>();
        let queued = Arc::new(AtomicU64::new(0));
        let changes = Arc::new(Changes::default());
        let stop = Arc::new(AtomicBool::new(false));
        let watch = Watch { link: link.clone(), stop: stop.clone(), changes: changes.clone() };
        let watcher = std::thread::Builder::new()
            .name("lmcache-remote-watch".to_owned())
            .spawn(move || watch.run())
            .map_err(|e| RemoteError::Thread("watcher", e))?;
        let (l, c, q, w) = (link.clone(), counters.clone(), queued.clone(), changes.clone());
        let writer = std::thread::Builder::new()
            .name("lmcache-remote-writer".to_owned())
            .spawn(move || writer_loop(&l, &c, &q, &w, rx))
            .map_err(|e| RemoteError::Thread("writer", e))?;
        Ok(RemoteTier {
            link,
            conn: Mutex::new(None),
            counters,
            tx: Some(Mutex::new(tx)),
            writer: Some(writer),
            queued,
            changes,
            watcher: Some(watcher),
            stop,
        })
    }

    /// How many of `keys`, from the first, the remote holds (one round trip). A remote that
    /// cannot be asked holds none.
    pub fn stored_prefix(&self, keys: &[ChunkKey]) -> usize {
        if keys.is_empty() {
            return 0;
        }
        let mut conn = lock(&self.conn);
        let found = self.link.run(&mut conn, "lookup", |c| {
            let mut p = redis::pipe();
            for k in keys {
                p.exists(redis_key(k));
            }
            p.query::<Vec<bool>>(c)
        });
        match found {
            Ok(v) => v.iter().take_while(|b| **b).count(),
            Err(skip) => {
                self.count_skip(skip);
                0
            }
        }
    }

    /// Reads and checks a chunk.
    pub fn get(&self, key: &ChunkKey) -> RemoteRead {
        let c = &self.counters;
        let got = {
            let mut conn = lock(&self.conn);
            self.link.run(&mut conn, "read", |conn| {
                redis::cmd("GET").arg(redis_key(key)).query::<Option<Vec<u8>>>(conn)
            })
        };
        match got {
            Ok(Some(buf)) => match check_record(*key, buf) {
                Ok(chunk) => {
                    add(&c.remote.hits, 1);
                    add(&c.remote.bytes_loaded, chunk.data().len() as u64);
                    RemoteRead::Hit(chunk)
                }
                Err(why) => {
                    add(&c.remote_corrupt, 1);
                    tracing::warn!("lmcache: remote chunk {} is corrupt ({why}); not loaded", redis_key(key));
                    RemoteRead::Corrupt(why)
                }
            },
            Ok(None) => {
                add(&c.remote_misses, 1);
                RemoteRead::Miss
            }
            Err(skip) => {
                self.count_skip(skip);
                add(&c.remote_misses, 1);
                RemoteRead::Miss
            }
        }
    }

    fn count_skip(&self, skip: Skip) {
        match skip {
            Skip::Backoff => add(&self.counters.remote_skipped, 1),
            Skip::Failed => add(&self.counters.remote_errors, 1),
        }
    }

    /// Hands a chunk to the writer thread (dropped, and counted, when the queue is full or the
    /// remote is in back-off).
    pub fn put(&self, key: ChunkKey, data: crate::cpu_tier::ChunkData) {
        let len = data.len() as u64;
        if !self.link.may_try() {
            add(&self.counters.remote_write_drops, 1);
            return;
        }
        if self.queued.load(Ordering::Relaxed) + len > QUEUE_BYTES {
            add(&self.counters.remote_write_drops, 1);
            return;
        }
        let Some(tx) = &self.tx else { return };
        self.queued.fetch_add(len, Ordering::Relaxed);
        if lock(tx).send(Job::Write(key, data)).is_err() {
            self.queued.fetch_sub(len, Ordering::Relaxed);
            add(&self.counters.remote_write_errors, 1);
        }
    }

    /// The chunks written and removed since the last call, in the order seen (at most
    /// [`crate::remote_watch::MAX_CHANGES`]; older ones are dropped from this list, not from
    /// the remote).
    pub fn take_changes(&self) -> Vec<RemoteChange> {
        self.changes.take()
    }

    /// Waits until every chunk handed to the writer so far is written (or dropped).
    pub fn flush(&self) {
        let Some(tx) = &self.tx else { return };
        let (done_tx, done_rx) = mpsc::channel();
        if lock(tx).send(Job::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        // Closing the channel ends the writer after what is queued.
        self.tx = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.watcher.take() {
            let _ = h.join();
        }
    }
}

fn writer_loop(link: &Link, c: &Counters, queued: &AtomicU64, changes: &Changes, rx: mpsc::Receiver<Job>) {
    let mut conn: Option<redis::Connection> = None;
    while let Ok(job) = rx.recv() {
        match job {
            Job::Flush(done) => {
                let _ = done.send(());
            }
            Job::Write(key, data) => {
                let record = encode_record(key, &data);
                let res = link.run(&mut conn, "write", |conn| {
                    redis::cmd("SET").arg(redis_key(&key)).arg(&record).query::<()>(conn)
                });
                match res {
                    Ok(()) => {
                        add(&c.remote_writes, 1);
                        add(&c.remote.bytes_stored, record.len() as u64);
                        changes.written(key);
                    }
                    Err(Skip::Backoff) => add(&c.remote_write_drops, 1),
                    Err(Skip::Failed) => add(&c.remote_write_errors, 1),
                }
                queued.fetch_sub(data.len() as u64, Ordering::Relaxed);
            }
        }
    }
}

//! Removals from the remote tier, for its KV events: Redis evicts, expires and deletes keys on
//! its own, so a thread subscribes to the server's keyevent notifications (`evicted`,
//! `expired`, `del`) and turns each kvconnect chunk key among them into a removal.
//!
//! Redis sends these only when its `notify-keyspace-events` setting asks for them (`E` with
//! `e`, `x` and `g`, or `EA`). The remote is shared with other engines, so kvconnect never
//! changes that setting: it reads it once per connection and, when removals would be missed,
//! says which flags are lacking and how to set them. Until they are set the remote tier
//! publishes its stores only.
//!
//! Only chunks this store wrote and has not yet reported removed are reported: the remote is
//! shared, and another engine's chunks are that engine's to publish. A notification sent
//! while the subscription is down (the server restarted, the link was cut) is lost. So after
//! every reconnection the watcher asks which of the chunks this store wrote are still there,
//! and reports the ones that are gone as removed: a server that restarted empty removes them
//! all.

use crate::key::{ChunkKey, FORMAT_VERSION};
use crate::remote_tier::{lock, redis_key, Link};
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The keyevent channels watched, in every database.
pub const CHANNELS: [&str; 3] = ["__keyevent@*__:evicted", "__keyevent@*__:expired", "__keyevent@*__:del"];

/// A change of the remote's contents, in the order it was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteChange {
    /// This store's writer put the chunk on the remote.
    Written(ChunkKey),
    /// The remote no longer holds the chunk (evicted, expired or deleted).
    Removed(ChunkKey),
}

/// Changes remembered at most between two takes; past it the oldest are dropped from this
/// list (the remote itself is not touched), and counted.
pub const MAX_CHANGES: usize = 1 << 16;

/// Chunks this store wrote and still claims, remembered at most (the newest kept; 16 bytes
/// each, about twice that with the bookkeeping). A chunk past it that Redis removes is not
/// reported.
pub const MAX_REMEMBERED: usize = 1 << 20;

/// What the writer and the watcher share with the store.
#[derive(Default)]
pub struct Changes {
    list: Mutex<VecDeque<RemoteChange>>,
    written: Mutex<Written>,
    dropped: std::sync::atomic::AtomicU64,
}

/// The chunks this store wrote and has not reported removed.
#[derive(Default)]
struct Written {
    held: HashSet<ChunkKey>,
    /// Oldest first; may still name chunks since removed (skipped when met).
    order: VecDeque<ChunkKey>,
}

impl Changes {
    /// Records a chunk the writer put on the remote.
    pub fn written(&self, k: ChunkKey) {
        let mut w = lock(&self.written);
        if w.held.insert(k) {
            w.order.push_back(k);
        }
        while w.held.len() > MAX_REMEMBERED {
            let Some(old) = w.order.pop_front() else { break };
            w.held.remove(&old);
        }
        if w.order.len() > 2 * w.held.len() + 1024 {
            let Written { held, order } = &mut *w;
            order.retain(|k| held.contains(k));
        }
        drop(w);
        self.push(RemoteChange::Written(k));
    }

    /// Records a chunk the remote no longer holds, if this store wrote it and still claims
    /// it; true when it did.
    pub fn removed(&self, k: ChunkKey) -> bool {
        if !lock(&self.written).held.remove(&k) {
            return false;
        }
        self.push(RemoteChange::Removed(k));
        true
    }

    fn push(&self, c: RemoteChange) {
        let mut l = lock(&self.list);
        if l.len() >= MAX_CHANGES {
            l.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        l.push_back(c);
    }

    /// The changes since the last call, in order.
    pub fn take(&self) -> Vec<RemoteChange> {
        lock(&self.list).drain(..).collect()
    }

    /// Changes dropped because nobody took them in time.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn remembered(&self) -> Vec<ChunkKey> {
        lock(&self.written).held.iter().copied().collect()
    }
}

/// The chunk a Redis key names, if it is one of kvconnect's (this format version).
pub fn chunk_of(redis_key: &str) -> Option<ChunkKey> {
    let prefix = format!("kvconnect:lmcache:v{FORMAT_VERSION}:");
    ChunkKey::from_hex(redis_key.strip_prefix(&prefix)?)
}

/// The flags `notify-keyspace-events` lacks for the watched channels (empty: none).
pub fn missing_flags(setting: &str) -> String {
    let has = |c: char| setting.contains(c);
    let mut missing = String::new();
    if !has('E') {
        missing.push('E');
    }
    for c in ['e', 'x', 'g'] {
        if !has(c) && !has('A') {
            missing.push(c);
        }
    }
    missing
}

/// What the watcher needs of the tier: its link (server, URL, timeout and the wait before
/// reconnecting), what stops it, and where removals go.
pub(crate) struct Watch {
    pub(crate) link: Arc<Link>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) changes: Arc<Changes>,
}

/// How often the watcher looks at `stop` while it waits for a notification.
const POLL: Duration = Duration::from_millis(200);

impl Watch {
    /// Runs until `stop` is set.
    pub fn run(self) {
        let mut warned = false;
        let mut first = true;
        while !self.stop.load(Ordering::Relaxed) {
            if let Err(e) = self.subscribed(&mut warned, first) {
                tracing::debug!(url = %self.link.url, "lmcache: the remote tier's key events are not \
                    received ({e}); subscribing again in {:?}", self.link.retry);
                let until = Instant::now() + self.link.retry;
                while Instant::now() < until && !self.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(POLL.min(self.link.retry));
                }
            }
            first = false;
        }
    }

    /// One subscription, until the connection fails or `stop` is set.
    fn subscribed(&self, warned: &mut bool, first: bool) -> redis::RedisResult<()> {
        let mut conn = self.link.connect()?;
        self.check_setting(&mut conn, warned);
        let mut ps = conn.as_pubsub();
        for ch in CHANNELS {
            ps.psubscribe(ch)?;
        }
        ps.set_read_timeout(Some(POLL))?;
        if !first {
            // Subscribed again: what was removed while the subscription was down was never
            // heard of. Checked on a connection of its own after subscribing, so that nothing
            // removed in between is missed.
            self.report_missing()?;
        }
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            match ps.get_message() {
                Ok(msg) => {
                    let key: String = msg.get_payload().unwrap_or_default();
                    if let Some(k) = chunk_of(&key) {
                        self.changes.removed(k);
                    }
                }
                Err(e) if e.is_timeout() => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Warns once when the server's setting leaves removals unsent.
    fn check_setting(&self, conn: &mut redis::Connection, warned: &mut bool) {
        if *warned {
            return;
        }
        let got: redis::RedisResult<Vec<String>> =
            redis::cmd("CONFIG").arg("GET").arg("notify-keyspace-events").query(conn);
        let why = match got {
            Ok(v) => {
                let setting = v.get(1).cloned().unwrap_or_default();
                let missing = missing_flags(&setting);
                if missing.is_empty() {
                    return;
                }
                format!(
                    "its notify-keyspace-events is '{setting}', which lacks '{missing}'; run \
                     `redis-cli -u {} CONFIG SET notify-keyspace-events Exeg` (or start redis-server \
                     with --notify-keyspace-events Exeg)",
                    self.link.url
                )
            }
            Err(e) => format!(
                "its notify-keyspace-events setting cannot be read ({e}); make sure it includes 'Exeg'"
            ),
        };
        *warned = true;
        tracing::warn!(
            url = %self.link.url,
            "lmcache: the remote tier cannot publish the chunks the server removes as KV events: {why}. \
                Until then the remote tier publishes its stores only, and a router may send requests for \
                chunks that are gone (they are misses, never wrong answers)"
        );
    }

    /// Reports the remembered chunks that the remote no longer holds as removed.
    fn report_missing(&self) -> redis::RedisResult<()> {
        let keys = self.changes.remembered();
        if keys.is_empty() {
            return Ok(());
        }
        let mut conn = self.link.connect()?;
        let mut gone = Vec::new();
        for part in keys.chunks(1024) {
            let mut p = redis::pipe();
            for k in part {
                p.exists(redis_key(k));
            }
            let found: Vec<bool> = p.query(&mut conn)?;
            gone.extend(part.iter().zip(found).filter(|(_, f)| !f).map(|(k, _)| *k));
        }
        for k in &gone {
            self.changes.removed(*k);
        }
        if !gone.is_empty() {
            tracing::info!(url = %self.link.url, "lmcache: after reconnecting, {} chunk(s) this worker wrote \
                are no longer on the remote tier; published as removed", gone.len());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_needed_for_every_channel() {
        assert_eq!(missing_flags(""), "Eexg");
        assert_eq!(missing_flags("Exeg"), "");
        assert_eq!(missing_flags("AKE"), "");
        assert_eq!(missing_flags("KA"), "E");
        assert_eq!(missing_flags("Ee"), "xg");
    }

    #[test]
    fn only_this_formats_chunk_keys_are_chunks() {
        let k = ChunkKey([0x0123_4567_89ab_cdef, 42]);
        assert_eq!(chunk_of(&redis_key(&k)), Some(k));
        assert_eq!(chunk_of("kvconnect:lmcache:v0:0123456789abcdef000000000000002a"), None);
        assert_eq!(chunk_of("someone:else"), None);
        assert_eq!(chunk_of(&format!("kvconnect:lmcache:v{FORMAT_VERSION}:nothex")), None);
    }

    #[test]
    fn the_oldest_changes_are_dropped_past_the_bound() {
        let c = Changes::default();
        for i in 0..(MAX_CHANGES + 3) as u64 {
            c.written(ChunkKey([i, 0]));
        }
        let got = c.take();
        assert_eq!(got.len(), MAX_CHANGES);
        assert_eq!(got[0], RemoteChange::Written(ChunkKey([3, 0])));
        assert_eq!(c.dropped(), 3);
        assert!(c.take().is_empty());
    }

    #[test]
    fn only_chunks_written_here_and_still_claimed_are_removed() {
        let c = Changes::default();
        let (a, b) = (ChunkKey([1, 1]), ChunkKey([2, 2]));
        c.written(a);
        assert!(!c.removed(b), "another engine's chunk is not this store's to remove");
        assert!(c.removed(a));
        assert!(!c.removed(a), "a chunk is removed once");
        assert_eq!(c.take(), vec![RemoteChange::Written(a), RemoteChange::Removed(a)]);
        // Written again after its removal: claimed again.
        c.written(a);
        assert!(c.removed(a));
        assert_eq!(c.remembered(), Vec::new());
    }

    #[test]
    fn churn_keeps_the_bookkeeping_bounded() {
        let c = Changes::default();
        for i in 0..100_000u64 {
            let k = ChunkKey([i, 0]);
            c.written(k);
            c.removed(k);
            let _ = c.take();
        }
        let w = lock(&c.written);
        assert!(w.held.is_empty() && w.order.len() <= 1024 + 1, "{}", w.order.len());
    }
}

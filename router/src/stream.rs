//! One worker's event stream as the indexer follows it: the sequence number it expects next,
//! whether it missed batches and waits for a replay, and whether the worker is dead.
//!
//! vLLM's publisher numbers its batches one after another and keeps the last ones for a
//! replay socket; a subscriber that sees a jump asks for the batches from the first one it
//! missed. Batches that arrive again (from a replay that overlaps) are dropped; a replay that
//! starts later than asked means the publisher no longer has the batches between, which are
//! counted as lost.

/// Where a worker's stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamState {
    /// No batch applied yet (a new worker, or one that restarted).
    Fresh,
    /// Every batch applied in order.
    Live,
    /// Batches missed: waiting for the replay from `from`.
    Stale { from: u64 },
    /// The worker is dead: nothing is applied, it is never routed to.
    Dead,
}

/// What to do with one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Apply it. `lost`: batches before it the publisher could no longer replay.
    Apply { lost: u64 },
    /// Drop it, for this reason.
    Drop(Dropped),
    /// Drop it and ask the worker's replay socket for the batches from `from`.
    Replay { from: u64 },
}

/// Why a batch was dropped: the label of `kvconnect_router_event_batches_dropped_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Its sequence number was already applied (a replay overlapping the live stream).
    Replayed,
    /// It came after a gap, while the replay is awaited (the replay brings it again).
    Gap,
    /// From a worker the router knows to be dead.
    Dead,
    /// It could not be decoded, or an event in it is invalid (a store or removal of no
    /// block): never applied, the stream goes on after it.
    Malformed,
    /// From a worker the router does not know.
    UnknownWorker,
}

impl Dropped {
    /// Every reason, in label order.
    pub const ALL: [Dropped; 5] =
        [Dropped::Replayed, Dropped::Gap, Dropped::Dead, Dropped::Malformed, Dropped::UnknownWorker];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Dropped::Replayed => "replayed",
            Dropped::Gap => "gap",
            Dropped::Dead => "dead_worker",
            Dropped::Malformed => "malformed",
            Dropped::UnknownWorker => "unknown_worker",
        }
    }
}

/// One worker's stream.
#[derive(Debug, Clone)]
pub struct Stream {
    state: StreamState,
    /// The sequence number expected next (None: fresh).
    next: Option<u64>,
    /// The highest sequence number seen, applied or not.
    highest: Option<u64>,
}

impl Default for Stream {
    fn default() -> Self {
        Stream { state: StreamState::Fresh, next: None, highest: None }
    }
}

impl Stream {
    /// Where it stands.
    pub fn state(&self) -> StreamState {
        self.state
    }

    /// Starts over, as a new stream (the worker restarted, or is alive again).
    pub fn reset(&mut self) {
        *self = Stream::default();
    }

    /// The worker died.
    pub fn kill(&mut self) {
        *self = Stream { state: StreamState::Dead, next: None, highest: None };
    }

    /// Decides on the batch numbered `seq`; `replay`: it came from the replay socket.
    pub fn admit(&mut self, seq: u64, replay: bool) -> Admit {
        if self.state == StreamState::Dead {
            return Admit::Drop(Dropped::Dead);
        }
        self.highest = Some(self.highest.map_or(seq, |h| h.max(seq)));
        let Some(next) = self.next else {
            // A stream joined after its start: its history comes from the replay first.
            if seq > 0 && !replay {
                self.next = Some(0);
                self.state = StreamState::Stale { from: 0 };
                return Admit::Replay { from: 0 };
            }
            return self.applied(seq, 0);
        };
        if seq < next {
            return Admit::Drop(Dropped::Replayed);
        }
        if seq == next {
            return self.applied(seq, 0);
        }
        if replay {
            // The publisher replays from the oldest batch it still has.
            return self.applied(seq, seq - next);
        }
        match self.state {
            StreamState::Stale { .. } => Admit::Drop(Dropped::Gap),
            _ => {
                self.state = StreamState::Stale { from: next };
                Admit::Replay { from: next }
            }
        }
    }

    fn applied(&mut self, seq: u64, lost: u64) -> Admit {
        self.next = Some(seq + 1);
        if self.highest.is_none_or(|h| seq >= h) {
            self.state = StreamState::Live;
        } else if self.state == StreamState::Fresh {
            self.state = StreamState::Stale { from: seq + 1 };
        }
        Admit::Apply { lost }
    }

    /// A batch numbered `seq` that could not be used (malformed): the stream goes on after
    /// it, as after an applied one.
    pub fn skip(&mut self, seq: u64) {
        if self.next == Some(seq) {
            self.applied(seq, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_asks_for_the_replay_once_and_the_replay_catches_up() {
        let mut s = Stream::default();
        assert_eq!(s.admit(0, false), Admit::Apply { lost: 0 });
        assert_eq!(s.admit(1, false), Admit::Apply { lost: 0 });
        assert_eq!(s.state(), StreamState::Live);
        assert_eq!(s.admit(4, false), Admit::Replay { from: 2 });
        assert_eq!(s.state(), StreamState::Stale { from: 2 });
        assert_eq!(s.admit(5, false), Admit::Drop(Dropped::Gap));
        for seq in 2..=4 {
            assert_eq!(s.admit(seq, true), Admit::Apply { lost: 0 });
            assert!(matches!(s.state(), StreamState::Stale { .. }), "not caught up at {seq}");
        }
        assert_eq!(s.admit(5, true), Admit::Apply { lost: 0 });
        assert_eq!(s.state(), StreamState::Live);
        assert_eq!(s.admit(3, true), Admit::Drop(Dropped::Replayed));
        assert_eq!(s.admit(6, false), Admit::Apply { lost: 0 });
    }

    #[test]
    fn a_late_subscriber_asks_for_history_and_counts_what_the_publisher_no_longer_has() {
        let mut s = Stream::default();
        assert_eq!(s.admit(10, false), Admit::Replay { from: 0 });
        // The publisher's buffer starts at 7: 0..7 are gone.
        assert_eq!(s.admit(7, true), Admit::Apply { lost: 7 });
        assert_eq!(s.admit(8, true), Admit::Apply { lost: 0 });
        assert!(matches!(s.state(), StreamState::Stale { .. }));
        assert_eq!(s.admit(9, true), Admit::Apply { lost: 0 });
        assert_eq!(s.admit(10, true), Admit::Apply { lost: 0 });
        assert_eq!(s.state(), StreamState::Live);
    }

    #[test]
    fn a_dead_worker_applies_nothing_until_it_starts_over() {
        let mut s = Stream::default();
        s.admit(0, false);
        s.kill();
        assert_eq!(s.admit(1, false), Admit::Drop(Dropped::Dead));
        s.reset();
        assert_eq!(s.admit(0, false), Admit::Apply { lost: 0 });
        assert_eq!(s.state(), StreamState::Live);
    }
}

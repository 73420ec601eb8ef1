//! What a decode engine remembers of each prefill engine it handshakes with: one slot per
//! peer, each with its own lock, so concurrent callers for one new peer handshake once and a
//! slow handshake holds up only that peer. An acceptance lasts until [`PeerSlots::forget`]
//! (a load from the peer failed, so it may have restarted); a refusal the caller deems
//! lasting is answered from memory for a bounded time, then the peer is asked again; any other
//! failure (an unreachable peer) is retried on the next call. Pure bookkeeping: the handshake
//! itself is the caller's closure.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
enum State<F> {
    Ready,
    Refused(F, Instant),
}

type Slot<F> = Arc<Mutex<Option<State<F>>>>;

/// Every peer's slot, by key.
#[derive(Debug)]
pub struct PeerSlots<K, F> {
    memory: Duration,
    slots: Mutex<HashMap<K, Slot<F>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<K: Eq + Hash + Clone, F: Clone> PeerSlots<K, F> {
    /// Slots whose lasting refusals are remembered for `memory`.
    pub fn new(memory: Duration) -> PeerSlots<K, F> {
        PeerSlots { memory, slots: Mutex::new(HashMap::new()) }
    }

    fn slot(&self, key: &K) -> Slot<F> {
        lock(&self.slots).entry(key.clone()).or_default().clone()
    }

    /// `Ok` once `key` accepted; the remembered refusal while it is fresh; else runs
    /// `handshake` under the peer's lock and remembers its answer (a failure only when
    /// `lasting` says so).
    pub fn ensure(
        &self,
        key: &K,
        handshake: impl FnOnce() -> Result<(), F>,
        lasting: impl Fn(&F) -> bool,
    ) -> Result<(), F> {
        let slot = self.slot(key);
        let mut state = lock(&slot);
        match &*state {
            Some(State::Ready) => return Ok(()),
            Some(State::Refused(f, at)) if at.elapsed() < self.memory => return Err(f.clone()),
            _ => {}
        }
        let outcome = handshake();
        *state = match &outcome {
            Ok(()) => Some(State::Ready),
            Err(f) if lasting(f) => Some(State::Refused(f.clone(), Instant::now())),
            Err(_) => None,
        };
        outcome
    }

    /// Forgets `key`: the next [`PeerSlots::ensure`] handshakes again.
    pub fn forget(&self, key: &K) {
        *lock(&self.slot(key)) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn accepts_once_remembers_lasting_refusals_for_a_while_and_retries_the_rest() {
        let slots: PeerSlots<&str, &str> = PeerSlots::new(Duration::from_millis(50));
        let calls = AtomicU32::new(0);
        let hs = |r: Result<(), &'static str>| {
            calls.fetch_add(1, Ordering::Relaxed);
            r
        };
        let lasting = |f: &&str| *f == "refused";
        assert!(slots.ensure(&"a", || hs(Ok(())), lasting).is_ok());
        assert!(slots.ensure(&"a", || hs(Err("refused")), lasting).is_ok(), "accepted: not asked again");
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        slots.forget(&"a");
        assert_eq!(
            slots.ensure(&"a", || hs(Err("refused")), lasting),
            Err("refused"),
            "asked again after forget"
        );
        assert_eq!(slots.ensure(&"a", || hs(Ok(())), lasting), Err("refused"), "refusal remembered");
        assert_eq!(calls.load(Ordering::Relaxed), 2);
        std::thread::sleep(Duration::from_millis(60));
        assert!(slots.ensure(&"a", || hs(Ok(())), lasting).is_ok(), "asked again once the memory ran out");
        assert_eq!(slots.ensure(&"b", || hs(Err("unreachable")), lasting), Err("unreachable"));
        assert!(slots.ensure(&"b", || hs(Ok(())), lasting).is_ok(), "an unreachable peer is retried");
        assert_eq!(calls.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn one_slow_peer_does_not_hold_up_another() {
        let slots: Arc<PeerSlots<u32, ()>> = Arc::new(PeerSlots::new(Duration::from_secs(30)));
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let s = slots.clone();
        let slow = std::thread::spawn(move || {
            s.ensure(
                &1,
                || {
                    let _ = entered_tx.send(());
                    let _ = release_rx.recv();
                    Ok(())
                },
                |_| true,
            )
        });
        entered_rx.recv().unwrap();
        // Peer 1's handshake is still running; peer 2's goes through.
        assert!(slots.ensure(&2, || Ok(()), |_| true).is_ok());
        release_tx.send(()).unwrap();
        assert!(slow.join().unwrap().is_ok());
    }
}

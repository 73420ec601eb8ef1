//! One object per engine, shared by the scheduler half and the worker half of a connector in
//! one process.
//!
//! A host creates the two halves separately; a connector whose halves share state (a cache,
//! a store) looks it up here by the engine's id and what it was built for: the first half
//! creates it, the second gets the same `Arc`. The table holds weak references, so the
//! object goes when the last half drops it. Each connector keeps its own table in a
//! `static`.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

struct Entry<T> {
    engine_id: String,
    identity: String,
    value: Weak<T>,
}

/// The objects of every engine of this process, by engine id and identity.
pub struct PerEngine<T> {
    entries: Mutex<Vec<Entry<T>>>,
}

impl<T> Default for PerEngine<T> {
    fn default() -> Self {
        PerEngine::new()
    }
}

impl<T> PerEngine<T> {
    /// An empty table (usable in a `static`).
    pub const fn new() -> PerEngine<T> {
        PerEngine { entries: Mutex::new(Vec::new()) }
    }

    fn entries(&self) -> MutexGuard<'_, Vec<Entry<T>>> {
        // A panic while holding the lock leaves a table of weak references that is still
        // correct.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live object of `engine_id` built for `identity`, else the one `make` builds. Before
    /// making one, `conflict` is shown the identity of every other live object of the engine
    /// and may refuse (a connector that allows one object per engine refuses them all).
    pub fn get_or_create<E>(
        &self,
        engine_id: &str,
        identity: &str,
        conflict: impl Fn(&str) -> Option<E>,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        let mut entries = self.entries();
        entries.retain(|e| e.value.strong_count() > 0);
        let mine = entries.iter().filter(|e| e.engine_id == engine_id);
        for e in mine {
            if e.identity == identity {
                if let Some(v) = e.value.upgrade() {
                    return Ok(v);
                }
            } else if let Some(refused) = conflict(&e.identity) {
                return Err(refused);
            }
        }
        let v = Arc::new(make()?);
        entries.push(Entry {
            engine_id: engine_id.to_owned(),
            identity: identity.to_owned(),
            value: Arc::downgrade(&v),
        });
        Ok(v)
    }

    /// The live objects of `engine_id`, oldest first.
    pub fn live(&self, engine_id: &str) -> Vec<Arc<T>> {
        self.entries().iter().filter(|e| e.engine_id == engine_id).filter_map(|e| e.value.upgrade()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_object_per_engine_and_identity_while_alive() {
        let t: PerEngine<String> = PerEngine::new();
        let ok = |_: &str| None::<String>;
        let a = t.get_or_create("e1", "x", ok, || Ok("a".to_owned())).unwrap();
        let b = t.get_or_create("e1", "x", ok, || Ok("b".to_owned())).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the second half gets the first's");
        let other = t.get_or_create("e2", "x", ok, || Ok("c".to_owned())).unwrap();
        assert!(!Arc::ptr_eq(&a, &other), "another engine gets its own");
        let y = t.get_or_create("e1", "y", ok, || Ok("d".to_owned())).unwrap();
        assert_eq!(t.live("e1").len(), 2, "identities coexist unless refused");
        let refuse = |existing: &str| Some(format!("taken by {existing}"));
        let e = t.get_or_create("e2", "z", refuse, || Ok("e".to_owned())).unwrap_err();
        assert_eq!(e, "taken by x");
        drop((a, b, y));
        assert!(t.live("e1").is_empty(), "gone with the last half");
        let again = t.get_or_create("e1", "x", refuse, || Ok("f".to_owned())).unwrap();
        assert_eq!(*again, "f");
    }

    #[test]
    fn a_failed_make_leaves_nothing() {
        let t: PerEngine<String> = PerEngine::new();
        let ok = |_: &str| None::<String>;
        assert_eq!(t.get_or_create("e", "x", ok, || Err("no".to_owned())).unwrap_err(), "no");
        assert!(t.live("e").is_empty());
    }
}

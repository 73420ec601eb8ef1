//! The panic guard: every call from the host into a plugin's connector runs inside
//! [`Poison::guard`] (`error.rs`). A panic becomes `ConnectorError::Panicked` and poisons
//! that instance, whose next call returns `ConnectorError::Poisoned`; the host keeps running.
//! The exported objects the plugin-side shims call hold the connector and its poison.

use crate::connector::{ConnectorContext, ConnectorFactory, SchedulerConnector, WorkerConnector};
use crate::error::{ConnectorError, Poison};
use std::sync::Mutex;

/// A plugin's factory behind the ABI: the connector's factory plus a poison flag.
pub(crate) struct ExportedFactory {
    name: &'static str,
    inner: Box<dyn ConnectorFactory>,
    // A factory is shared between threads, so its poison flag is behind a lock; factory calls
    // are setup-time, never per step.
    poison: Mutex<Poison>,
}

impl ExportedFactory {
    /// Builds the factory, catching a panic in its constructor.
    pub fn new(name: &'static str, make: fn() -> Box<dyn ConnectorFactory>) -> Result<Self, ConnectorError> {
        let inner = Poison::default().guard(name, "the factory constructor", || Ok(make()))?;
        Ok(ExportedFactory { name, inner, poison: Mutex::new(Poison::default()) })
    }

    /// The connector name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// Runs one factory method, guarded.
    pub fn call<T>(
        &self,
        method: &str,
        f: impl FnOnce(&dyn ConnectorFactory) -> Result<T, ConnectorError>,
    ) -> Result<T, ConnectorError> {
        let mut poison = self.poison.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let was = poison.is_poisoned();
        let r = poison.guard(self.name, method, || f(self.inner.as_ref()));
        if !was && poison.is_poisoned() {
            *self.poison.lock().unwrap_or_else(|e| e.into_inner()) = poison;
        }
        r
    }

    /// Creates a scheduler half.
    pub fn create_scheduler(&self, ctx: &ConnectorContext) -> Result<ExportedScheduler, ConnectorError> {
        let inner = self.call("create_scheduler", |f| f.create_scheduler(ctx))?;
        Ok(ExportedScheduler { name: self.name, inner, poison: Poison::default() })
    }

    /// Creates a worker half.
    pub fn create_worker(&self, ctx: &ConnectorContext) -> Result<ExportedWorker, ConnectorError> {
        let inner = self.call("create_worker", |f| f.create_worker(ctx))?;
        Ok(ExportedWorker { name: self.name, inner, poison: Poison::default() })
    }
}

/// A connector half behind the ABI: its name, the connector, and the poison a panic leaves.
pub(crate) struct Exported<C: ?Sized> {
    name: &'static str,
    inner: Box<C>,
    poison: Poison,
}

/// A scheduler half behind the ABI.
pub(crate) type ExportedScheduler = Exported<dyn SchedulerConnector>;

/// A worker half behind the ABI.
pub(crate) type ExportedWorker = Exported<dyn WorkerConnector>;

impl<C: ?Sized> Exported<C> {
    /// The connector name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// Runs one method, guarded; a panic poisons this instance.
    #[inline]
    pub fn call<T>(
        &mut self,
        method: &str,
        f: impl FnOnce(&mut C) -> Result<T, ConnectorError>,
    ) -> Result<T, ConnectorError> {
        let inner = &mut self.inner;
        self.poison.guard(self.name, method, || f(inner.as_mut()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_poisons_and_next_call_is_refused() {
        let mut poison = Poison::default();
        let r: Result<(), _> = poison.guard("t", "save_kv_layer", || panic!("boom"));
        assert!(matches!(r, Err(ConnectorError::Panicked { ref message, .. }) if message == "boom"), "{r:?}");
        let r = poison.guard("t", "wait_for_save", || Ok(()));
        assert!(
            matches!(r, Err(ConnectorError::Poisoned { ref message, .. }) if message.contains("boom")),
            "{r:?}"
        );
    }

    #[test]
    fn errors_pass_through_without_poisoning() {
        let mut poison = Poison::default();
        let r: Result<(), _> = poison.guard("t", "m", || Err(ConnectorError::invalid("t", "no")));
        assert!(matches!(r, Err(ConnectorError::InvalidArgument { .. })));
        assert!(!poison.is_poisoned());
    }
}

//! The panic guard: every call from the host into a plugin's connector runs inside
//! `catch_unwind` here. A panic becomes `ConnectorError::Panicked` and poisons that
//! instance, whose next call returns `ConnectorError::Poisoned`; the host keeps running. The
//! exported objects the plugin-side shims call hold the connector and its poison flag.

use crate::connector::{ConnectorContext, ConnectorFactory, SchedulerConnector, WorkerConnector};
use crate::error::panic_message;
use crate::error::ConnectorError;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// Runs `f`, turning a panic into `Panicked` and recording it in `poison`.
#[inline]
fn guarded<T>(
    connector: &str,
    method: &str,
    poison: &mut Option<String>,
    f: impl FnOnce() -> Result<T, ConnectorError>,
) -> Result<T, ConnectorError> {
    if let Some(message) = poison {
        return Err(ConnectorError::Poisoned { connector: connector.to_owned(), message: message.clone() });
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            *poison = Some(format!("in {method}: {message}"));
            Err(ConnectorError::Panicked {
                connector: connector.to_owned(),
                method: method.to_owned(),
                message,
            })
        }
    }
}

/// A plugin's factory behind the ABI: the connector's factory plus a poison flag.
pub(crate) struct ExportedFactory {
    name: &'static str,
    inner: Box<dyn ConnectorFactory>,
    // A factory is shared between threads, so its poison flag is behind a lock; factory calls
    // are setup-time, never per step.
    poison: Mutex<Option<String>>,
}

impl ExportedFactory {
    /// Builds the factory, catching a panic in its constructor.
    pub fn new(name: &'static str, make: fn() -> Box<dyn ConnectorFactory>) -> Result<Self, ConnectorError> {
        let mut poison = None;
        let inner = guarded(name, "the factory constructor", &mut poison, || Ok(make()))?;
        Ok(ExportedFactory { name, inner, poison: Mutex::new(None) })
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
        let was = poison.is_some();
        let r = guarded(self.name, method, &mut poison, || f(self.inner.as_ref()));
        if !was && poison.is_some() {
            *self.poison.lock().unwrap_or_else(|e| e.into_inner()) = poison;
        }
        r
    }

    /// Creates a scheduler half.
    pub fn create_scheduler(&self, ctx: &ConnectorContext) -> Result<ExportedScheduler, ConnectorError> {
        let inner = self.call("create_scheduler", |f| f.create_scheduler(ctx))?;
        Ok(ExportedScheduler { name: self.name, inner, poison: None })
    }

    /// Creates a worker half.
    pub fn create_worker(&self, ctx: &ConnectorContext) -> Result<ExportedWorker, ConnectorError> {
        let inner = self.call("create_worker", |f| f.create_worker(ctx))?;
        Ok(ExportedWorker { name: self.name, inner, poison: None })
    }
}

/// A connector half behind the ABI: its name, the connector, and the poison a panic leaves.
pub(crate) struct Exported<C: ?Sized> {
    name: &'static str,
    inner: Box<C>,
    poison: Option<String>,
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
        guarded(self.name, method, &mut self.poison, || f(inner.as_mut()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_poisons_and_next_call_is_refused() {
        let mut poison = None;
        let r: Result<(), _> = guarded("t", "save_kv_layer", &mut poison, || panic!("boom"));
        assert!(matches!(r, Err(ConnectorError::Panicked { ref message, .. }) if message == "boom"), "{r:?}");
        let r = guarded("t", "wait_for_save", &mut poison, || Ok(()));
        assert!(
            matches!(r, Err(ConnectorError::Poisoned { ref message, .. }) if message.contains("boom")),
            "{r:?}"
        );
    }

    #[test]
    fn errors_pass_through_without_poisoning() {
        let mut poison = None;
        let r: Result<(), _> = guarded("t", "m", &mut poison, || Err(ConnectorError::invalid("t", "no")));
        assert!(matches!(r, Err(ConnectorError::InvalidArgument { .. })));
        assert!(poison.is_none());
    }
}

//! The plugin author's side of the ABI: implement the safe traits, then
//! `export_connector!("name", MyFactory::new())`. Nothing here is `unsafe`; the raw entry
//! points live in `abi`.
//!
//! What the SDK does for a plugin:
//! * every call into the connector runs inside `catch_unwind`: a panic becomes
//!   `ConnectorError::Panicked` and poisons that instance, whose next call returns
//!   `ConnectorError::Poisoned`; the host keeps running;
//! * at load it installs a `tracing` subscriber inside the plugin that forwards every event
//!   (level, target, message and fields) to the host's log callback, and a panic hook that
//!   logs panics there instead of writing to stderr.

use crate::connector::{ConnectorContext, ConnectorFactory, SchedulerConnector, WorkerConnector};
use crate::error::ConnectorError;
use crate::ffi::{log_level, HostApi};
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Exports a connector factory from a `cdylib` through the kvconnect C ABI.
///
/// ```ignore
/// kvconnect_api::export_connector!("example", example::ExampleFactory::new());
/// ```
///
/// The first argument is the connector name the plugin registers; the second an expression
/// evaluated once, when the host loads the plugin, that yields a `ConnectorFactory`. The
/// plugin version is the crate's `CARGO_PKG_VERSION`. Use it once per library.
#[macro_export]
macro_rules! export_connector {
    ($name:expr, $factory:expr $(,)?) => {
        #[doc(hidden)]
        pub struct __KvconnectMakeFactory;

        impl $crate::ffi::MakeFactory for __KvconnectMakeFactory {
            const NAME: &'static str = $name;
            const VERSION: &'static str = env!("CARGO_PKG_VERSION");
            fn make() -> ::std::boxed::Box<dyn $crate::ConnectorFactory> {
                ::std::boxed::Box::new($factory)
            }
        }

        /// The kvconnect plugin entry point.
        #[no_mangle]
        pub extern "C" fn kvconnect_plugin_entry() -> &'static $crate::ffi::PluginDescriptor {
            static DESCRIPTOR: $crate::ffi::PluginDescriptor =
                $crate::ffi::PluginDescriptor::new::<__KvconnectMakeFactory>();
            &DESCRIPTOR
        }
    };
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

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
pub struct ExportedFactory {
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

/// A scheduler half behind the ABI.
pub struct ExportedScheduler {
    name: &'static str,
    inner: Box<dyn SchedulerConnector>,
    poison: Option<String>,
}

impl ExportedScheduler {
    /// The connector name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// Runs one method, guarded; a panic poisons this instance.
    #[inline]
    pub fn call<T>(
        &mut self,
        method: &str,
        f: impl FnOnce(&mut dyn SchedulerConnector) -> Result<T, ConnectorError>,
    ) -> Result<T, ConnectorError> {
        let inner = &mut self.inner;
        guarded(self.name, method, &mut self.poison, || f(inner.as_mut()))
    }
}

/// A worker half behind the ABI.
pub struct ExportedWorker {
    name: &'static str,
    inner: Box<dyn WorkerConnector>,
    poison: Option<String>,
}

impl ExportedWorker {
    /// The connector name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// Runs one method, guarded; a panic poisons this instance.
    #[inline]
    pub fn call<T>(
        &mut self,
        method: &str,
        f: impl FnOnce(&mut dyn WorkerConnector) -> Result<T, ConnectorError>,
    ) -> Result<T, ConnectorError> {
        let inner = &mut self.inner;
        guarded(self.name, method, &mut self.poison, || f(inner.as_mut()))
    }
}

static HOST: OnceLock<&'static HostApi> = OnceLock::new();

/// Called once per load with the host's callbacks: checks the host speaks our major,
/// installs the log bridge and the panic hook.
pub fn init(api: &'static HostApi) -> Result<(), ConnectorError> {
    if api.abi_major != crate::ffi::ABI_MAJOR || api.struct_size < crate::ffi::MIN_HOST_API_SIZE {
        return Err(ConnectorError::Other {
            connector: "plugin".into(),
            message: format!(
                "this plugin speaks kvconnect ABI {}.{} but the host speaks {}.{} (host API struct of {} bytes, need {})",
                crate::ffi::ABI_MAJOR,
                crate::ffi::ABI_MINOR,
                api.abi_major,
                api.abi_minor,
                api.struct_size,
                crate::ffi::MIN_HOST_API_SIZE
            ),
        });
    }
    if HOST.set(api).is_err() {
        // Loaded twice by the same host: the first bridge stays.
        return Ok(());
    }
    let filter = match api.max_log_level {
        log_level::OFF => LevelFilter::OFF,
        log_level::ERROR => LevelFilter::ERROR,
        log_level::WARN => LevelFilter::WARN,
        log_level::INFO => LevelFilter::INFO,
        log_level::DEBUG => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    };
    let subscriber = tracing_subscriber::registry().with(HostLogLayer { api }.with_filter(filter));
    // Inside a cdylib this is the plugin's own copy of tracing, so it cannot displace the
    // host's subscriber; it fails only if the plugin set one itself, which then wins.
    let _ = tracing::subscriber::set_global_default(subscriber);
    std::panic::set_hook(Box::new(|info| {
        // The panic is also returned to the host as an error; this adds where it happened.
        tracing::error!(target: "panic", "{info}");
    }));
    Ok(())
}

/// Forwards tracing events to the host's log callback.
struct HostLogLayer {
    api: &'static HostApi,
}

impl<S: Subscriber> Layer<S> for HostLogLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let level = match *meta.level() {
            Level::ERROR => log_level::ERROR,
            Level::WARN => log_level::WARN,
            Level::INFO => log_level::INFO,
            Level::DEBUG => log_level::DEBUG,
            Level::TRACE => log_level::TRACE,
        };
        let mut v = MessageVisitor::default();
        event.record(&mut v);
        self.api.log(level, meta.target(), &v.text);
    }
}

/// Renders an event as `message key=value ...`.
#[derive(Default)]
struct MessageVisitor {
    text: String,
}

impl Visit for MessageVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.text.insert_str(0, value);
        } else {
            self.text.push_str(&format!(" {}={}", field.name(), value));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.text.insert_str(0, &format!("{value:?}"));
        } else {
            self.text.push_str(&format!(" {}={:?}", field.name(), value));
        }
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

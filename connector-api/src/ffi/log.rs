//! The log bridge: the host's [`HostApi`] (its version and its logger), handed to the
//! plugin's `init`, which the SDK keeps to forward `tracing` events; the plugin side's
//! subscriber that does so; and the host side's logger that receives them.

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

use super::shim::finish;
use super::*;
use core::ffi::c_void;
use std::sync::OnceLock;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Log levels on the wire.
pub mod log_level {
    /// Nothing is logged.
    pub const OFF: u32 = 0;
    /// `ERROR`.
    pub const ERROR: u32 = 1;
    /// `WARN`.
    pub const WARN: u32 = 2;
    /// `INFO`.
    pub const INFO: u32 = 3;
    /// `DEBUG`.
    pub const DEBUG: u32 = 4;
    /// `TRACE`.
    pub const TRACE: u32 = 5;
}

/// What the host gives a plugin at load. The host keeps it alive for the life of the
/// process (plugins are never unloaded), so the plugin may keep the pointer.
#[repr(C)]
#[derive(Debug)]
pub struct HostApi {
    /// `size_of::<HostApi>()` as the host was built.
    pub struct_size: usize,
    /// The host's ABI major.
    pub abi_major: u16,
    /// The host's ABI minor.
    pub abi_minor: u16,
    /// The most verbose level the host will show ([`log_level`]); the plugin drops the rest.
    pub max_log_level: u32,
    /// Passed back to `log` unchanged.
    pub user_data: *const c_void,
    /// Receives one log event: level, target (module path), message. Thread-safe.
    pub log: Option<
        unsafe extern "C" fn(user_data: *const c_void, level: u32, target: AbiBytes, message: AbiBytes),
    >,
}

// SAFETY: the host promises `log` may be called from any thread with `user_data`, and the
// struct itself is never written after load.
unsafe impl Sync for HostApi {}
// SAFETY: as above.
unsafe impl Send for HostApi {}

impl HostApi {
    /// Sends one log event to the host.
    pub fn log(&self, level: u32, target: &str, message: &str) {
        if let Some(log) = self.log {
            // SAFETY: the host gave us `log` and `user_data` for this purpose; both byte views
            // are valid for the call.
            unsafe {
                log(
                    self.user_data,
                    level,
                    AbiBytes::from_slice(target.as_bytes()),
                    AbiBytes::from_slice(message.as_bytes()),
                )
            }
        }
    }
}

pub(super) unsafe extern "C" fn plugin_init(host: *const HostApi, err: *mut AbiBuffer) -> Status {
    let r = if host.is_null() {
        Err(ConnectorError::Other {
            connector: "plugin".into(),
            message: "the host passed no host API".into(),
        })
    } else {
        // SAFETY: the host keeps its HostApi alive for the life of the process (documented
        // on `HostApi`), so a 'static borrow is sound.
        let api: &'static HostApi = unsafe { &*host };
        install(api)
    };
    finish(r, err, |()| ())
}

/// The plugin side of the bridge: the host API this plugin was loaded with.
static HOST: OnceLock<&'static HostApi> = OnceLock::new();

/// The plugin's `init`, once per load with the host's callbacks: checks the host speaks our
/// major, installs the log bridge and a panic hook that logs there instead of to stderr.
fn install(api: &'static HostApi) -> Result<(), ConnectorError> {
    if api.abi_major != crate::ffi::ABI_MAJOR || api.struct_size < crate::ffi::MIN_HOST_API_SIZE {
        return Err(ConnectorError::Other {
            connector: "plugin".into(),
            message: format!(
                "this plugin speaks kvconnect ABI {}.{} but the host speaks {}.{} (host API struct of {} \
                    bytes, need {})",
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

// ---------------------------------------------------------------------------------------
// The host side: the HostApi each plugin gets, and its logger, which forwards to `tracing`.

/// The [`HostApi`] for the plugin named `plugin`: this ABI's version, the most verbose level
/// `tracing` has on, and a logger that tags each line with the plugin.
pub fn host_api_for(plugin: &str) -> &'static HostApi {
    use tracing::level_filters::LevelFilter;
    let max = match LevelFilter::current() {
        LevelFilter::OFF => log_level::OFF,
        LevelFilter::ERROR => log_level::ERROR,
        LevelFilter::WARN => log_level::WARN,
        LevelFilter::INFO => log_level::INFO,
        LevelFilter::DEBUG => log_level::DEBUG,
        _ => log_level::TRACE,
    };
    // Leaked on purpose: the plugin keeps the pointer for the life of the process, and
    // plugins are never unloaded (one small allocation per plugin).
    let name: &'static String = Box::leak(Box::new(plugin.to_owned()));
    Box::leak(Box::new(HostApi {
        struct_size: std::mem::size_of::<HostApi>(),
        abi_major: ABI_MAJOR,
        abi_minor: ABI_MINOR,
        max_log_level: max,
        user_data: name as *const String as *const c_void,
        log: Some(host_log),
    }))
}

unsafe extern "C" fn host_log(user_data: *const c_void, level: u32, target: AbiBytes, message: AbiBytes) {
    // A panic must not unwind into the plugin's frames.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: `user_data` is the leaked name `host_api_for` made; the byte views are
        // valid for this call (the plugin's contract).
        let (plugin, target, message) =
            unsafe { (&*(user_data as *const String), target.to_string_lossy(), message.to_string_lossy()) };
        match level {
            log_level::ERROR => {
                tracing::error!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            log_level::WARN => {
                tracing::warn!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            log_level::INFO => {
                tracing::info!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            log_level::DEBUG => {
                tracing::debug!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            _ => {
                tracing::trace!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
        }
    });
}

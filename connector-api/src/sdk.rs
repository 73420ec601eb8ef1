//! The plugin author's side of the ABI: implement the safe traits, then
//! `export_connector!("name", MyFactory::new())`. Nothing here is `unsafe`; the raw entry
//! points live in `ffi`.
//!
//! What the SDK does for a plugin:
//! * every call into the connector runs inside `catch_unwind` (`ffi/panic_guard.rs`): a panic
//!   becomes `ConnectorError::Panicked` and poisons that instance, whose next call returns
//!   `ConnectorError::Poisoned`; the host keeps running;
//! * at load it installs a `tracing` subscriber inside the plugin that forwards every event
//!   (level, target, message and fields) to the host's log callback, and a panic hook that
//!   logs panics there instead of writing to stderr (`ffi/log.rs`).

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

//! The error every connector method returns.

use serde::{Deserialize, Serialize};

/// What went wrong inside a connector. Crosses the plugin boundary as its `kind` code plus
/// the message, so a host sees the same error from a built-in and from a plugin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum ConnectorError {
    /// The data path behind this method is not built.
    #[error("connector '{connector}': {method} is not implemented")]
    NotImplemented {
        /// The connector.
        connector: String,
        /// The method.
        method: String,
    },
    /// The connector's config cannot be used.
    #[error("connector '{connector}': invalid config: {message}")]
    InvalidConfig {
        /// The connector.
        connector: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A call came in the wrong order or with arguments that do not fit the connector's state.
    #[error("connector '{connector}': {message}")]
    InvalidArgument {
        /// The connector.
        connector: String,
        /// What is wrong.
        message: String,
    },
    /// An earlier call panicked; this instance refuses further calls.
    #[error("connector '{connector}' is poisoned: an earlier call panicked ({message}); recreate it")]
    Poisoned {
        /// The connector.
        connector: String,
        /// The panic's message.
        message: String,
    },
    /// The call panicked.
    #[error("connector '{connector}' panicked in {method}: {message}")]
    Panicked {
        /// The connector.
        connector: String,
        /// The method.
        method: String,
        /// The panic's message.
        message: String,
    },
    /// An I/O, transport or peer failure.
    #[error("connector '{connector}': {message}")]
    Io {
        /// The connector.
        connector: String,
        /// What failed.
        message: String,
    },
    /// Anything else, with its message.
    #[error("connector '{connector}': {message}")]
    Other {
        /// The connector.
        connector: String,
        /// The message.
        message: String,
    },
}

/// The text of a caught panic's payload (`std::panic::catch_unwind`'s `Err`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Why a connector instance refuses every call: an earlier call of it panicked (empty until
/// then). One home for the rule behind the plugin ABI (`ffi::panic_guard`) and wherever else a
/// host calls a connector half in process (the vLLM adapter's scheduler link).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Poison(Option<String>);

impl Poison {
    /// Whether a call panicked.
    pub fn is_poisoned(&self) -> bool {
        self.0.is_some()
    }

    /// Runs `f`, the call `method` of `connector`, unless an earlier call panicked
    /// (`Poisoned`, with that panic's message). A panic in `f` becomes `Panicked` and poisons
    /// from then on; an error passes through and poisons nothing.
    #[inline]
    pub fn guard<T>(
        &mut self,
        connector: &str,
        method: &str,
        f: impl FnOnce() -> Result<T, ConnectorError>,
    ) -> Result<T, ConnectorError> {
        if let Some(message) = &self.0 {
            return Err(ConnectorError::Poisoned {
                connector: connector.to_owned(),
                message: message.clone(),
            });
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(r) => r,
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                self.0 = Some(format!("in {method}: {message}"));
                Err(ConnectorError::Panicked {
                    connector: connector.to_owned(),
                    method: method.to_owned(),
                    message,
                })
            }
        }
    }
}

impl ConnectorError {
    /// True when the instance that returned this is unusable from now on: the call
    /// panicked, or an earlier one did (`Poisoned`). The host must stop calling it.
    pub fn poisons_instance(&self) -> bool {
        matches!(self, ConnectorError::Panicked { .. } | ConnectorError::Poisoned { .. })
    }

    /// Shorthand for `NotImplemented`.
    pub fn not_implemented(connector: &str, method: &str) -> Self {
        ConnectorError::NotImplemented { connector: connector.to_owned(), method: method.to_owned() }
    }

    /// Shorthand for `InvalidConfig`.
    pub fn config(connector: &str, message: impl Into<String>) -> Self {
        ConnectorError::InvalidConfig { connector: connector.to_owned(), message: message.into() }
    }

    /// Shorthand for `InvalidArgument`.
    pub fn invalid(connector: &str, message: impl Into<String>) -> Self {
        ConnectorError::InvalidArgument { connector: connector.to_owned(), message: message.into() }
    }

    /// Shorthand for `Io`.
    pub fn io(connector: &str, message: impl Into<String>) -> Self {
        ConnectorError::Io { connector: connector.to_owned(), message: message.into() }
    }
}

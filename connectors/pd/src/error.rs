//! What can go wrong while building or running a composite.

use kvconnect_api::ConnectorError;

/// The name the composite uses in errors.
pub const PD: &str = "pd";

/// A composite config that cannot be used, or a child that misbehaves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PdError {
    /// `kv_connector_extra_config.connectors` is missing or empty.
    #[error(
        "the composite has no children: set kv_connector_extra_config.connectors to a list of child \
        kv-transfer-configs, e.g. [{{\"kv_connector\":\"LMCacheConnectorV1\"}}, \
        {{\"kv_connector\":\"NixlConnector\"}}]"
    )]
    NoChildren,
    /// `connectors` is not a list of objects.
    #[error("kv_connector_extra_config.connectors must be a list of kv-transfer-config objects; {what}")]
    BadChildList {
        /// What was found instead.
        what: String,
    },
    /// A child entry is not a valid kv-transfer-config.
    #[error("child {index} of the composite is not a valid kv-transfer-config: {message}")]
    BadChild {
        /// 0-based position in `connectors`.
        index: usize,
        /// serde's message.
        message: String,
    },
    /// A child names a connector nobody provides.
    #[error(
        "child {index} of the composite: cannot resolve connector '{name}': {}",
        with_known(message, known)
    )]
    UnknownChild {
        /// 0-based position in `connectors`.
        index: usize,
        /// The name as written.
        name: String,
        /// The resolver's message.
        message: String,
        /// Every name the resolver knows.
        known: Vec<String>,
    },
    /// A key of `kv_connector_extra_config` the composite does not know.
    #[error("unknown key(s) {} in the composite's kv_connector_extra_config; valid keys are 'connectors' and \
        'lookup'", keys.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(", "))]
    UnknownKeys {
        /// The keys.
        keys: Vec<String>,
    },
    /// `lookup` has a value the composite does not know.
    #[error(
        "kv_connector_extra_config.lookup is {given}; valid values are \"first_hit\" (the first child \
        with a hit wins) and \"sum\" (each child continues where the previous one stopped)"
    )]
    BadLookup {
        /// The value as JSON.
        given: String,
    },
    /// Two children have the same name and `unique_names` was asked for.
    #[error(
        "two children of the composite are both named '{name}' (children {first} and {second}); child \
        names key the handshake metadata and the connector metadata, so each must be unique"
    )]
    DuplicateName {
        /// The name.
        name: String,
        /// 0-based index of the first.
        first: usize,
        /// 0-based index of the second.
        second: usize,
    },
    /// Composites nested deeper than `MAX_DEPTH`.
    #[error(
        "composites are nested {depth} deep ({chain}); at most {max} levels are allowed: flatten the \
        inner composites into one child list"
    )]
    TooDeep {
        /// The depth reached.
        depth: usize,
        /// The limit.
        max: usize,
        /// The chain of connector names, outermost first.
        chain: String,
    },
    /// A composite contains itself.
    #[error(
        "composite '{name}' contains itself ({chain}): a composite's children must not refer back to it"
    )]
    Loop {
        /// The connector that recurs.
        name: String,
        /// The chain of connector names, outermost first, ending with the repeat.
        chain: String,
    },
    /// Children whose capabilities cannot be combined.
    #[error("the composite's children cannot work together: {0}")]
    Incompatible(String),
    /// A child's own error, with the child named.
    #[error("child '{child}': {source}")]
    Child {
        /// The child's name.
        child: String,
        /// Its error.
        #[source]
        source: ConnectorError,
    },
    /// Connector metadata that does not match this composite's children.
    #[error("connector metadata does not fit this composite: {0}")]
    BadMeta(String),
    /// Two children set the same transfer-param key.
    #[error(
        "children '{first}' and '{second}' both set kv_transfer_params key '{key}' for request \
        {request}; rename the key in one of them, or drop one of the two children"
    )]
    ParamClash {
        /// The key.
        key: String,
        /// The first child that set it.
        first: String,
        /// The second.
        second: String,
        /// The request.
        request: String,
    },
    /// Peer handshake metadata that fits none of this composite's children.
    #[error("peer handshake metadata does not fit this composite: {0}")]
    BadPeer(String),
}

/// The resolver's message, with the known names appended unless it already lists them.
pub fn with_known(message: &str, known: &[String]) -> String {
    if !known.is_empty() && known.iter().all(|k| message.contains(k.as_str())) {
        message.to_owned()
    } else {
        format!("{message}; known connectors: {}", known.join(", "))
    }
}

impl From<PdError> for ConnectorError {
    fn from(e: PdError) -> Self {
        match e {
            // A child's own error keeps its kind so the host sees e.g. NotImplemented as such.
            PdError::Child { child, source } => match source {
                ConnectorError::NotImplemented { method, .. } => {
                    ConnectorError::NotImplemented { connector: format!("{PD}/{child}"), method }
                }
                other => ConnectorError::Other {
                    connector: PD.to_owned(),
                    message: format!("child '{child}': {other}"),
                },
            },
            PdError::BadMeta(_) | PdError::ParamClash { .. } | PdError::BadPeer(_) => {
                ConnectorError::InvalidArgument { connector: PD.to_owned(), message: e.to_string() }
            }
            _ => ConnectorError::InvalidConfig { connector: PD.to_owned(), message: e.to_string() },
        }
    }
}

/// A child's error, named by the child.
pub(crate) fn child_err(name: &str, e: kvconnect_api::ConnectorError) -> kvconnect_api::ConnectorError {
    PdError::Child { child: name.to_owned(), source: e }.into()
}

/// The children's metrics, merged ([`kvconnect_api::ConnectorMetric::merge`]). A child that
/// cannot answer is left out with a warning, so that one child's error hides no other's counts.
pub(crate) fn merged_metrics<'a>(
    answers: impl IntoIterator<
        Item = (&'a str, kvconnect_api::ConnectorResult<Vec<kvconnect_api::ConnectorMetric>>),
    >,
) -> Vec<kvconnect_api::ConnectorMetric> {
    let mut out = Vec::new();
    for (name, answer) in answers {
        match answer {
            Ok(m) => kvconnect_api::ConnectorMetric::merge(&mut out, m),
            Err(e) => tracing::warn!("{}; the other children's metrics are shown", child_err(name, e)),
        }
    }
    out
}

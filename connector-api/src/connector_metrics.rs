//! What a connector counts for the host's `GET /metrics`: its own Prometheus samples, handed
//! over through `SchedulerConnector::metrics` and `WorkerConnector::metrics` (and the plugin
//! ABI's `metrics` entries), so a plugin reports exactly as a built-in connector does.
//!
//! The host asks at scrape time, adds up the samples of equal name and labels (the
//! scheduler half's and every tensor-parallel rank's), and drops, with one warning, any that
//! [`ConnectorMetric::check`] refuses.

use crate::connector::{ConnectorResult, SchedulerConnector, WorkerConnector};
use serde::{Deserialize, Serialize};

/// Counter or gauge, as Prometheus has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricKind {
    /// Only grows (the host adds `_total` to the name).
    Counter,
    /// Goes up and down.
    Gauge,
}

/// One sample: a family's name and help, its kind, this sample's labels and value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorMetric {
    /// The family's name, e.g. `kvconnect_cache_hits` (a counter's without `_total`).
    pub name: String,
    /// One line saying what it counts.
    pub help: String,
    /// Counter or gauge.
    pub kind: MetricKind,
    /// Label names and values, e.g. `[["tier", "disk"]]`.
    #[serde(default)]
    pub labels: Vec<(String, String)>,
    /// The value now (a counter's total since the connector started).
    pub value: u64,
}

/// Why a connector's sample cannot be shown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricError {
    /// The family's name is not a Prometheus name.
    #[error(
        "metric name {0:?} is not a Prometheus name (letters, digits, '_' and ':', not starting with a \
         digit); rename it in the connector"
    )]
    BadName(String),
    /// A label's name is not a Prometheus label name.
    #[error(
        "metric {name}: label name {label:?} is not a Prometheus label name (letters, digits and '_', not \
         starting with a digit or '__'); rename it in the connector"
    )]
    BadLabel {
        /// The family.
        name: String,
        /// The label.
        label: String,
    },
    /// A counter's name ends in `_total`, which the host adds itself.
    #[error("metric {0}: a counter's name must not end in _total (the host adds it); drop the suffix")]
    TotalSuffix(String),
}

impl ConnectorMetric {
    /// A counter sample.
    pub fn counter(name: &str, help: &str, value: u64) -> ConnectorMetric {
        ConnectorMetric {
            name: name.into(),
            help: help.into(),
            kind: MetricKind::Counter,
            labels: vec![],
            value,
        }
    }

    /// A gauge sample.
    pub fn gauge(name: &str, help: &str, value: u64) -> ConnectorMetric {
        ConnectorMetric {
            name: name.into(),
            help: help.into(),
            kind: MetricKind::Gauge,
            labels: vec![],
            value,
        }
    }

    /// With one more label.
    pub fn label(mut self, name: &str, value: &str) -> ConnectorMetric {
        self.labels.push((name.into(), value.into()));
        self
    }

    /// Whether the host can show it.
    pub fn check(&self) -> Result<(), MetricError> {
        let name_ok = |s: &str, colon: bool| {
            let mut chars = s.chars();
            matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'))
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
        };
        if !name_ok(&self.name, true) {
            return Err(MetricError::BadName(self.name.clone()));
        }
        if self.kind == MetricKind::Counter && self.name.ends_with("_total") {
            return Err(MetricError::TotalSuffix(self.name.clone()));
        }
        match self.labels.iter().find(|(l, _)| !name_ok(l, false) || l.starts_with("__")) {
            Some((l, _)) => Err(MetricError::BadLabel { name: self.name.clone(), label: l.clone() }),
            None => Ok(()),
        }
    }

    /// Adds `more` to `into`: a sample of the same name, kind and labels as one there adds
    /// its value to it (the halves and ranks of one connector, or two connectors counting
    /// into one family); the others are appended in order.
    pub fn merge(into: &mut Vec<ConnectorMetric>, more: Vec<ConnectorMetric>) {
        for m in more {
            let same = into.iter_mut().find(|s| s.name == m.name && s.kind == m.kind && s.labels == m.labels);
            match same {
                Some(s) => s.value = s.value.saturating_add(m.value),
                None => into.push(m),
            }
        }
    }
}

/// The counter of a producer's holds ended (the blocks it kept for a consumer, then freed),
/// labelled `how`: `done` (a consumer finished reading) or `expired` (none finished within the
/// lease: it never pulled, or its `done` was lost, and the blocks stayed held until then).
/// Hosts read it to tell a send that ended by its lease from one a consumer finished.
pub const KV_HOLDS_ENDED: &str = "kvconnect_kv_holds_ended";

/// The counter of a consumer's loads from a prefill engine by where their copy started,
/// labelled `on`: `step` (by `start_load_kv` itself, a GPU gather launched without waiting) or
/// `pull_thread`.
pub const KV_LOADS_STARTED: &str = "kvconnect_kv_loads_started";

/// The holds that ended by their lease, over `samples` ([`KV_HOLDS_ENDED`] with `how` =
/// `expired`, every connector's and child's added up).
pub fn holds_expired(samples: &[ConnectorMetric]) -> u64 {
    samples
        .iter()
        .filter(|m| m.name == KV_HOLDS_ENDED && m.kind == MetricKind::Counter)
        .filter(|m| m.labels.iter().any(|(k, v)| k == "how" && v == "expired"))
        .fold(0u64, |a, m| a.saturating_add(m.value))
}

/// What one connector counts: its scheduler half's samples and its worker half's, merged.
pub fn of_connector(
    scheduler: &mut dyn SchedulerConnector,
    worker: &mut dyn WorkerConnector,
) -> ConnectorResult<Vec<ConnectorMetric>> {
    let mut out = scheduler.metrics()?;
    ConnectorMetric::merge(&mut out, worker.metrics()?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_are_checked_as_prometheus_does() {
        assert_eq!(
            ConnectorMetric::counter("kvconnect_cache_hits", "h", 1).label("tier", "disk").check(),
            Ok(())
        );
        assert_eq!(ConnectorMetric::gauge("vllm:kv_blocks", "h", 1).check(), Ok(()));
        let bad = ConnectorMetric::counter("9lives", "h", 1).check().unwrap_err();
        assert!(bad.to_string().contains("\"9lives\" is not a Prometheus name"), "{bad}");
        assert!(ConnectorMetric::counter("a b", "h", 1).check().is_err());
        assert!(ConnectorMetric::counter("", "h", 1).check().is_err());
        let label = ConnectorMetric::counter("x", "h", 1).label("ti:er", "d").check().unwrap_err();
        assert!(label.to_string().contains("label name \"ti:er\""), "{label}");
        assert!(ConnectorMetric::counter("x", "h", 1).label("__name__", "d").check().is_err());
        let total = ConnectorMetric::counter("x_total", "h", 1).check().unwrap_err();
        assert!(total.to_string().contains("must not end in _total"), "{total}");
        assert_eq!(ConnectorMetric::gauge("x_total", "h", 1).check(), Ok(()));
    }

    #[test]
    fn merge_adds_equal_samples_and_keeps_the_others_in_order() {
        let a = |tier: &str, v| ConnectorMetric::counter("hits", "h", v).label("tier", tier);
        let mut all = vec![a("cpu", 1), a("disk", 2)];
        ConnectorMetric::merge(
            &mut all,
            vec![a("disk", 3), a("remote", 4), ConnectorMetric::gauge("hits", "h", 5)],
        );
        assert_eq!(all.iter().map(|m| m.value).collect::<Vec<_>>(), vec![1, 5, 4, 5]);
        assert_eq!(all[2].labels, vec![("tier".to_owned(), "remote".to_owned())]);
        assert_eq!(all[3].kind, MetricKind::Gauge, "a gauge of the same name is not a counter's sample");
    }

    #[test]
    fn holds_expired_adds_the_expired_samples_alone() {
        let ended = |how: &str, v| ConnectorMetric::counter(KV_HOLDS_ENDED, "h", v).label("how", how);
        let samples = vec![
            ended("done", 5),
            ended("expired", 2),
            ConnectorMetric::counter("other", "h", 9).label("how", "expired"),
            ConnectorMetric::gauge(KV_HOLDS_ENDED, "h", 7).label("how", "expired"),
            ended("expired", 1),
        ];
        assert_eq!(holds_expired(&samples), 3);
        assert_eq!(holds_expired(&[]), 0);
    }

    #[test]
    fn reads_the_json_a_plugin_writes() {
        let m: ConnectorMetric = serde_json::from_str(
            r#"{"name":"my_hits","help":"Hits.","kind":"counter","labels":[["tier","disk"]],"value":7}"#,
        )
        .unwrap();
        assert_eq!(m, ConnectorMetric::counter("my_hits", "Hits.", 7).label("tier", "disk"));
        let m: ConnectorMetric =
            serde_json::from_str(r#"{"name":"g","help":"","kind":"gauge","value":0}"#).unwrap();
        assert!(m.labels.is_empty());
    }
}

//! How long `kvconnect plugins` waits for one plugin's query process: 10 s, unless
//! `--query-timeout SECS` or `KVCONNECT_PLUGIN_QUERY_TIMEOUT` says otherwise.

use std::time::Duration;

/// The environment variable holding the time limit, in seconds.
pub const QUERY_TIMEOUT_ENV: &str = "KVCONNECT_PLUGIN_QUERY_TIMEOUT";

/// The time limit when neither the flag nor the environment sets one.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// The time limit: the flag's, else the environment variable's (`env`, its value if set),
/// else the default.
pub fn query_timeout(flag: Option<Duration>, env: Option<&str>) -> anyhow::Result<Duration> {
    match (flag, env) {
        (Some(d), _) => Ok(d),
        (None, Some(v)) => parse_secs(v).map_err(|e| anyhow::anyhow!("{QUERY_TIMEOUT_ENV}: {e}")),
        (None, None) => Ok(DEFAULT_QUERY_TIMEOUT),
    }
}

/// A time limit in seconds (`10`, `2.5`); clap's parser for `--query-timeout`.
pub fn parse_secs(text: &str) -> Result<Duration, String> {
    let bad = || format!("'{text}' is not a time limit in seconds: give a positive number such as 10 or 2.5");
    let secs: f64 = text.trim().parse().map_err(|_| bad())?;
    if !secs.is_finite() || secs <= 0.0 {
        return Err(bad());
    }
    Duration::try_from_secs_f64(secs).map_err(|_| bad())
}

/// A time limit as people write it: `10 s`, `2.5 s`.
pub fn shown(limit: Duration) -> String {
    format!("{} s", limit.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_then_the_environment_then_the_default() {
        let two = Duration::from_secs(2);
        assert_eq!(query_timeout(Some(two), Some("5")).unwrap(), two);
        assert_eq!(query_timeout(None, Some("5")).unwrap(), Duration::from_secs(5));
        assert_eq!(query_timeout(None, None).unwrap(), DEFAULT_QUERY_TIMEOUT);
        let e = query_timeout(None, Some("soon")).unwrap_err().to_string();
        assert!(e.starts_with(QUERY_TIMEOUT_ENV) && e.contains("'soon'"), "{e}");
    }

    #[test]
    fn seconds_are_positive_numbers() {
        assert_eq!(parse_secs("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(parse_secs(" 3 "), Ok(Duration::from_secs(3)));
        for bad in ["0", "-1", "NaN", "inf", "", "3s", "1e300"] {
            assert!(parse_secs(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits_read_as_seconds() {
        assert_eq!(shown(Duration::from_secs(10)), "10 s");
        assert_eq!(shown(Duration::from_millis(2500)), "2.5 s");
    }
}

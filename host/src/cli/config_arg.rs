//! `--kv-transfer-config`, as every subcommand reads it: vLLM's JSON inline, or the path of a
//! file holding it.

use anyhow::{Context, Result};
use kvconnect_api::KvTransferConfig;

/// Reads `--kv-transfer-config`: inline JSON when the argument starts with `{` (after white
/// space), else the path of a file holding the JSON.
pub fn read_config(arg: &str) -> Result<KvTransferConfig> {
    if arg.trim_start().starts_with('{') {
        return KvTransferConfig::from_json(arg).context("--kv-transfer-config");
    }
    let text = kvconnect_config_file::read_text(std::path::Path::new(arg)).with_context(|| {
        format!(
            "--kv-transfer-config {arg}: not inline JSON (that starts with '{{') and not a readable file; \
             pass the JSON itself or the path of a file holding it"
        )
    })?;
    KvTransferConfig::from_json(&text).with_context(|| format!("--kv-transfer-config {arg}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(e: &anyhow::Error) -> String {
        format!("{e:#}")
    }

    #[test]
    fn inline_json_with_leading_space() {
        let c = read_config(r#"  {"kv_connector":"NixlConnector","kv_role":"kv_both"}"#).unwrap();
        assert_eq!(c.kv_connector, "NixlConnector");
    }

    #[test]
    fn a_file_holding_the_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.json");
        std::fs::write(&path, "\n  {\"kv_connector\": \"LMCacheConnectorV1\"}\n").unwrap();
        let c = read_config(path.to_str().unwrap()).unwrap();
        assert_eq!(c.kv_connector, "LMCacheConnectorV1");
    }

    #[test]
    fn a_missing_file_says_what_was_expected() {
        let e = chain(&read_config("/nonexistent/kv.json").unwrap_err());
        assert!(e.starts_with("--kv-transfer-config /nonexistent/kv.json: not inline JSON"), "{e}");
        assert!(e.contains("not a readable file"), "{e}");
    }

    #[test]
    fn bad_json_names_the_file_or_the_option() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.json");
        std::fs::write(&path, "{\"kv_connector\": ").unwrap();
        let arg = path.to_str().unwrap();
        let e = chain(&read_config(arg).unwrap_err());
        assert!(e.starts_with(&format!("--kv-transfer-config {arg}: ")), "{e}");
        let e = chain(&read_config("{\"kv_connector\": 3}").unwrap_err());
        assert!(e.starts_with("--kv-transfer-config: "), "{e}");
    }
}

//! What the config targets share: an input split into a config file, environment lines and
//! an extra-config JSON object, and the file written where the variable names it.

use serde_json::{Map, Value};
use std::path::PathBuf;

/// The three parts of one input, separated by NUL bytes: file text, `KEY=VALUE` lines, the
/// extra config as JSON (an empty map when it is not an object).
pub struct ConfigInput {
    /// The config file's text.
    pub file: Vec<u8>,
    /// Environment variables.
    pub env: Vec<(String, String)>,
    /// `kv_connector_extra_config`.
    pub extra: Map<String, Value>,
}

impl ConfigInput {
    /// Splits `data`.
    pub fn split(data: &[u8]) -> ConfigInput {
        let mut parts = data.splitn(3, |b| *b == 0);
        let file = parts.next().unwrap_or_default().to_vec();
        let env = String::from_utf8_lossy(parts.next().unwrap_or_default())
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .collect();
        let extra = match serde_json::from_slice(parts.next().unwrap_or_default()) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        ConfigInput { file, env, extra }
    }

    /// Writes the file part to this process's scratch file and returns its path: in
    /// `KVCONNECT_FUZZ_SCRATCH` where it names a directory (`scripts/fuzz.sh` gives each target
    /// one and removes it after), else in `/dev/shm`, memory-backed (a file written per input
    /// on a busy disk costs milliseconds), else in the temporary directory.
    pub fn write_file(&self, ext: &str) -> PathBuf {
        let shm = std::path::Path::new("/dev/shm");
        let dir = match std::env::var_os("KVCONNECT_FUZZ_SCRATCH").map(PathBuf::from) {
            Some(d) if d.is_dir() => d,
            _ if shm.is_dir() => shm.to_path_buf(),
            _ => std::env::temp_dir(),
        };
        let p = dir.join(format!("kvconnect-fuzz-{}.{ext}", std::process::id()));
        std::fs::write(&p, &self.file).expect("scratch file");
        p
    }
}

//! The deployment's data-plane secret, from a file or the environment (`kvconnect worker`,
//! `kvconnect up`).

use anyhow::{anyhow, bail, Context, Result};
use kvconnect_dataplane::auth::{Secret, SECRET_ENV};
use std::path::Path;

/// The deployment's data-plane secret: from `file` (which only its owner may read), else from
/// `KVCONNECT_SIDE_CHANNEL_TOKEN`, else none.
pub fn data_plane_secret(file: Option<&Path>) -> Result<Option<Secret>> {
    if let Some(f) = file {
        let meta =
            std::fs::metadata(f).with_context(|| format!("--secret-file {}: cannot read it", f.display()))?;
        let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
        if mode & 0o077 != 0 {
            bail!(
                "--secret-file {}: group or others may access it (mode {:o}); run `chmod 600 {}`",
                f.display(),
                mode & 0o777,
                f.display()
            );
        }
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("--secret-file {}: cannot read it", f.display()))?;
        return Secret::from_text(&text, &format!("--secret-file {}", f.display()))
            .map(Some)
            .map_err(|e| anyhow!("{e}"));
    }
    match std::env::var(SECRET_ENV) {
        Ok(t) if !t.trim().is_empty() => {
            Secret::from_text(&t, SECRET_ENV).map(Some).map_err(|e| anyhow!("{e}"))
        }
        _ => Ok(None),
    }
}

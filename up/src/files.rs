//! The deployment `kvconnect up` runs: the user's file, or the embedded default written to a
//! private temporary directory (with the reference model's config beside it, at the same
//! relative path as in the repository) so `up` works from any directory.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The embedded default deployment (examples/deployments/default-up.toml).
pub const DEFAULT_DEPLOYMENT: &str = include_str!("../../examples/deployments/default-up.toml");
/// The reference model's config.json the default deployment names.
pub const REFERENCE_MODEL: &str = include_str!("../../fixtures/models/kvconnect--reference/config.json");

/// A deployment file on disk; a temporary one is removed on drop.
pub struct DeploymentFiles {
    /// The file to pass to the servers.
    pub path: PathBuf,
    temp: Option<PathBuf>,
}

impl DeploymentFiles {
    /// The user's file (made absolute), or the embedded default written out.
    pub fn resolve(user: Option<&Path>) -> Result<DeploymentFiles> {
        if let Some(p) = user {
            let path = std::path::absolute(p)
                .with_context(|| format!("deployment {}: cannot resolve the path", p.display()))?;
            if !path.is_file() {
                anyhow::bail!("deployment {}: no such file", path.display());
            }
            return Ok(DeploymentFiles { path, temp: None });
        }
        let dir = std::env::temp_dir().join(format!("kvconnect-up-{}", std::process::id()));
        let write = |rel: &str, text: &str| -> Result<PathBuf> {
            let p = dir.join(rel);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("cannot create {}", parent.display()))?;
            }
            std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?;
            Ok(p)
        };
        let files = DeploymentFiles {
            path: dir.join("examples/deployments/default-up.toml"),
            temp: Some(dir.clone()),
        };
        write("fixtures/models/kvconnect--reference/config.json", REFERENCE_MODEL)?;
        write("examples/deployments/default-up.toml", DEFAULT_DEPLOYMENT)?;
        Ok(files)
    }
}

impl Drop for DeploymentFiles {
    fn drop(&mut self) {
        if let Some(d) = &self.temp {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_default_parses_and_is_removed_on_drop() {
        let f = DeploymentFiles::resolve(None).unwrap();
        let d = kvconnect_deployment::Deployment::load(&f.path).unwrap();
        assert!(d.model_path.ends_with("kvconnect--reference/config.json"));
        let dir = f.temp.clone().unwrap();
        drop(f);
        assert!(!dir.exists());
    }
}

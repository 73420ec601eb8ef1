//! Finding and loading the NIXL C library (`libnixl_capi.so`) before the first NIXL call.
//!
//! `nixl-sys` is built against stubs that `dlopen` the library by bare name on their first
//! call and abort the process when it is not found. So this module looks for it first —
//! `NIXL_LIB_DIR`, else `.nixl/x/.nixl_cu12.mesonpy.libs` (what `scripts/fetch-nixl.sh`
//! unpacks) under the current directory, the source tree or the executable's ancestors — and
//! opens it by full path with `RTLD_GLOBAL`, which makes the stubs' later by-name `dlopen`
//! find it. A missing library is an ordinary error that says how to get it.
//!
//! Never call `nixl_sys::is_stub()` before [`load`]: the stubs try their `dlopen` once and
//! remember a failure for the life of the process.

#![allow(unsafe_code)] // Opens the NIXL shared library (dlopen).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming the directory that holds `libnixl_capi.so`.
pub const ENV: &str = "NIXL_LIB_DIR";
/// Where `scripts/fetch-nixl.sh` unpacks the library, relative to the repository root.
pub const DEFAULT_DIR: &str = ".nixl/x/.nixl_cu12.mesonpy.libs";
/// The C API library.
pub const CAPI: &str = "libnixl_capi.so";

/// Why the NIXL library cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NixlLibError {
    /// This build was made without feature `nixl`.
    #[error(
        "this kvconnect was built without NIXL support: rebuild with `--features nixl` (e.g. `cargo \
        build --release -p kvconnect-host --features nixl`; needs libclang, `apt-get install -y \
        libclang-dev`)"
    )]
    NotBuilt,
    /// `NIXL_LIB_DIR` is set but has no `libnixl_capi.so`.
    #[error(
        "NIXL_LIB_DIR={dir} has no {CAPI}: point NIXL_LIB_DIR at the directory holding it \
        (scripts/fetch-nixl.sh prints it), or unset it"
    )]
    EnvDirMissing {
        /// The directory named.
        dir: String,
    },
    /// Not found anywhere.
    #[error(
        "NIXL library not found: no {CAPI} in $NIXL_LIB_DIR (unset) or in {DEFAULT_DIR} under \
        {searched}; run scripts/fetch-nixl.sh (downloads the pinned nixl-cu12 1.5.1 wheel into .nixl/) or \
        set NIXL_LIB_DIR to a directory holding {CAPI}"
    )]
    NotFound {
        /// The directories searched, for the message.
        searched: String,
    },
    /// Found but it would not load.
    #[error(
        "NIXL library {path} cannot be loaded: {reason}; run scripts/fetch-nixl.sh again or set \
        NIXL_LIB_DIR to a working copy"
    )]
    Load {
        /// The file.
        path: String,
        /// The loader's message.
        reason: String,
    },
}

/// Directories searched for `DEFAULT_DIR` when `NIXL_LIB_DIR` is unset: the current directory,
/// the executable's directory and their ancestors, and this source tree's root.
fn search_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    let mut push_ancestors = |p: &Path| {
        for a in p.ancestors() {
            if !roots.iter().any(|r| r == a) {
                roots.push(a.to_path_buf());
            }
        }
    };
    if let Ok(cwd) = std::env::current_dir() {
        push_ancestors(&cwd);
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            push_ancestors(dir);
        }
    }
    // connectors/nixl -> the repository root, for binaries run from elsewhere in development.
    push_ancestors(Path::new(env!("CARGO_MANIFEST_DIR")));
    roots
}

/// The directory holding `libnixl_capi.so`, without loading anything.
pub fn find() -> Result<PathBuf, NixlLibError> {
    if !cfg!(feature = "nixl") {
        return Err(NixlLibError::NotBuilt);
    }
    if let Some(dir) = std::env::var_os(ENV).filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        return if dir.join(CAPI).is_file() {
            Ok(dir)
        } else {
            Err(NixlLibError::EnvDirMissing { dir: dir.display().to_string() })
        };
    }
    let roots = search_roots();
    for r in &roots {
        let d = r.join(DEFAULT_DIR);
        if d.join(CAPI).is_file() {
            return Ok(d);
        }
    }
    let mut searched: Vec<String> = roots.iter().take(6).map(|p| p.display().to_string()).collect();
    if roots.len() > 6 {
        searched.push(format!("{} more ancestors", roots.len() - 6));
    }
    Err(NixlLibError::NotFound { searched: searched.join(", ") })
}

/// NIXL transfer backends whose plugins are present next to the library (`plugins/libplugin_X.so`).
pub fn plugins(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir.join("plugins"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("libplugin_").and_then(|s| s.strip_suffix(".so")).map(str::to_owned)
        })
        .collect();
    out.sort();
    out
}

static LOADED: OnceLock<Result<PathBuf, NixlLibError>> = OnceLock::new();

/// Finds and loads the library once per process; later calls return the first outcome.
/// On `Ok`, `nixl_sys` calls reach the real library.
pub fn load() -> Result<&'static Path, NixlLibError> {
    LOADED.get_or_init(load_once).as_ref().map(PathBuf::as_path).map_err(Clone::clone)
}

#[cfg(not(feature = "nixl"))]
fn load_once() -> Result<PathBuf, NixlLibError> {
    Err(NixlLibError::NotBuilt)
}

#[cfg(feature = "nixl")]
fn load_once() -> Result<PathBuf, NixlLibError> {
    let dir = find()?;
    let path = dir.join(CAPI);
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading runs the library's initialisers; libnixl_capi.so (NVIDIA's NIXL C API
    // from the pinned wheel) has no initialiser with preconditions on the caller. RTLD_GLOBAL
    // makes its symbols, and its soname, visible to the stubs' later dlopen.
    let lib = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| NixlLibError::Load { path: path.display().to_string(), reason: e.to_string() })?;
    // Kept loaded for the life of the process: NIXL objects hold pointers into it.
    std::mem::forget(lib);
    if nixl_sys::is_stub() {
        return Err(NixlLibError::Load {
            path: path.display().to_string(),
            reason:
                "loaded, but nixl-sys still runs its stubs (another libnixl_capi.so was found first by name?)"
                    .into(),
        });
    }
    tracing::debug!(dir = %dir.display(), "NIXL library loaded");
    Ok(dir)
}

/// What `kvconnect plugins inspect nixl` shows about this machine: the backends usable here
/// and, for `nixl`, where the library is or why it is not usable. Does not load anything.
pub fn availability() -> (Vec<String>, String) {
    let mut backends = vec!["shm".to_owned(), "tcp".to_owned()];
    let note = match find() {
        Ok(dir) => {
            backends.push("nixl".to_owned());
            let p = plugins(&dir);
            format!(
                "nixl: library {} (NIXL transfer plugins: {})",
                dir.display(),
                if p.is_empty() { "none found".to_owned() } else { p.join(", ") }
            )
        }
        Err(e) => format!("nixl: unavailable: {e}"),
    };
    (backends, note)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_message_says_how_to_get_it() {
        let e = NixlLibError::NotFound { searched: "/x".into() }.to_string();
        assert!(e.contains("scripts/fetch-nixl.sh") && e.contains("NIXL_LIB_DIR"), "{e}");
        let e = NixlLibError::EnvDirMissing { dir: "/nope".into() }.to_string();
        assert!(e.contains("/nope") && e.contains(CAPI), "{e}");
    }

    #[test]
    fn plugins_are_read_from_the_plugins_directory() {
        let d = std::env::temp_dir().join(format!("kvc-nixl-plugins-{}", std::process::id()));
        std::fs::create_dir_all(d.join("plugins")).unwrap();
        std::fs::write(d.join("plugins/libplugin_UCX.so"), b"").unwrap();
        std::fs::write(d.join("plugins/libplugin_POSIX.so"), b"").unwrap();
        std::fs::write(d.join("plugins/README"), b"").unwrap();
        assert_eq!(plugins(&d), vec!["POSIX".to_owned(), "UCX".to_owned()]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}

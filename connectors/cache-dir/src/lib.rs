//! A directory of cache files that one worker owns (the lmcache disk tier, the flexkv SSD
//! tier). KV is derived from users' prompts, so these files are as private as the prompts:
//!
//! * the directory is created with mode 0700; an existing one that another user owns, or
//!   that group or others can write (they could plant files that would then be served as
//!   KV), is refused;
//! * a lock file (`.lock`, holding the owner's pid) is held with `flock` for as long as the
//!   directory is open: a second worker on the same directory is refused, naming the first;
//!   the lock goes with the process, so a crash leaves nothing to clean up by hand;
//! * files are created with mode 0600, `O_CREAT|O_EXCL|O_NOFOLLOW`, under names with 64
//!   random bits, so a file or symlink planted at the target path is never followed or
//!   reused;
//! * [`sync_file`] and [`CacheDir::sync`] make a file's bytes and its name durable before the
//!   caller indexes it.
//!
//! This crate holds no cache logic; it must not decide what is cached.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Name of the lock file in each cache directory.
pub const LOCK_FILE: &str = ".lock";

/// Why a cache directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheDirError {
    /// It cannot be created, opened or locked.
    #[error("{setting} '{path}' cannot be used: {source}; point {setting} at a writable directory")]
    Io {
        /// The setting that named it (for the remedy), e.g. `local_disk`.
        setting: String,
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// It is not a directory.
    #[error("{setting} '{path}' exists and is not a directory; point {setting} at a directory")]
    NotADirectory {
        /// The setting.
        setting: String,
        /// The path.
        path: PathBuf,
    },
    /// Another user owns it, or others can write it.
    #[error(
        "{setting} '{path}' {why}: they could read the cached KV or plant files that would be served as \
        KV; point {setting} at a directory of this user's own (kvconnect creates a missing one with mode \
        0700), or chmod go-w it"
    )]
    NotPrivate {
        /// The setting.
        setting: String,
        /// The directory.
        path: PathBuf,
        /// What is wrong, e.g. `is writable by other users (mode 1777)`.
        why: String,
    },
    /// Another worker holds it.
    #[error("{setting} '{path}' is in use by another worker ({holder}); give each worker its own {setting}")]
    Busy {
        /// The setting.
        setting: String,
        /// The directory.
        path: PathBuf,
        /// Who holds it, as its lock file says (`pid 1234`).
        holder: String,
    },
}

/// An open, locked cache directory. The lock is released when it is dropped.
#[derive(Debug)]
pub struct CacheDir {
    path: PathBuf,
    dir: File,
    _lock: File,
}

impl CacheDir {
    /// Opens `path` for this worker alone, creating it (and missing parents) with mode 0700.
    /// `setting` names the config key that gave the path, for messages.
    pub fn open(path: &Path, setting: &str) -> Result<CacheDir, CacheDirError> {
        let io = |source| CacheDirError::Io { setting: setting.to_owned(), path: path.to_owned(), source };
        make_dirs(path, setting)?;
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_dir() {
            return Err(CacheDirError::NotADirectory { setting: setting.to_owned(), path: path.to_owned() });
        }
        let me = rustix::process::geteuid().as_raw();
        let mode = meta.permissions().mode() & 0o7777;
        let why = if meta.uid() != me {
            Some(format!("belongs to uid {}, not to this worker's uid {me}", meta.uid()))
        } else if mode & 0o022 != 0 {
            Some(format!("is writable by other users (mode {mode:o})"))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(CacheDirError::NotPrivate {
                setting: setting.to_owned(),
                path: path.to_owned(),
                why,
            });
        }
        let lock = lock(path).map_err(|e| match e {
            LockError::Held(holder) => {
                CacheDirError::Busy { setting: setting.to_owned(), path: path.to_owned(), holder }
            }
            LockError::Io(e) => io(e),
        })?;
        let dir = File::open(path).map_err(io)?;
        Ok(CacheDir { path: path.to_owned(), dir, _lock: lock })
    }

    /// Creates a new subdirectory `<prefix>-<random>` of `parent` (created 0700 if missing)
    /// and opens it: for a worker whose files last only while it runs, so that several
    /// workers can share `parent`. Subdirectories `<prefix>-*` that no live worker holds
    /// (left by one that crashed) are removed first.
    pub fn create_unique(parent: &Path, prefix: &str, setting: &str) -> Result<CacheDir, CacheDirError> {
        let io = |source| CacheDirError::Io { setting: setting.to_owned(), path: parent.to_owned(), source };
        make_dirs(parent, setting)?;
        sweep_stale(parent, prefix);
        // Made and locked under a hidden name, then renamed: a sweep by another worker
        // starting at the same time never sees it unlocked.
        let name = format!("{prefix}-{}", random_hex().map_err(io)?);
        let tmp = parent.join(format!(".{name}"));
        // Not recursive: fails if anything is already there.
        DirBuilder::new().mode(0o700).create(&tmp).map_err(io)?;
        let lock = lock(&tmp).map_err(|e| match e {
            LockError::Held(holder) => io(io::Error::other(format!("new directory locked by {holder}"))),
            LockError::Io(e) => io(e),
        })?;
        let path = parent.join(name);
        std::fs::rename(&tmp, &path).map_err(io)?;
        let dir = File::open(&path).map_err(io)?;
        Ok(CacheDir { path, dir, _lock: lock })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates a new file `<stem>.tmp-<random>` in the directory, mode 0600, refusing
    /// anything already at that path (a symlink included). Returns its path and the file,
    /// open for reading and writing.
    pub fn create_temp(&self, stem: &str) -> io::Result<(PathBuf, File)> {
        let path = self.path.join(format!("{stem}.tmp-{}", random_hex()?));
        let f = create_private(&path)?;
        Ok((path, f))
    }

    /// Makes the directory's entries (a rename into it, a removal) durable.
    pub fn sync(&self) -> io::Result<()> {
        self.dir.sync_all()
    }
}

/// Creates `path` and missing parents with mode 0700 (an existing directory keeps its mode).
fn make_dirs(path: &Path, setting: &str) -> Result<(), CacheDirError> {
    DirBuilder::new().recursive(true).mode(0o700).create(path).map_err(|source| {
        if path.exists() && !path.is_dir() {
            CacheDirError::NotADirectory { setting: setting.to_owned(), path: path.to_owned() }
        } else {
            CacheDirError::Io { setting: setting.to_owned(), path: path.to_owned(), source }
        }
    })
}

/// Creates `path` with mode 0600, `O_EXCL|O_NOFOLLOW`: an error if anything, a symlink
/// included, is already there.
pub fn create_private(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Takes an exclusive `flock` on `f` without waiting: `false` when another open file (in
/// this process or another) holds it. Released when `f` is closed, or its process dies.
pub fn try_lock(f: &File) -> io::Result<bool> {
    match rustix::fs::flock(f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Flushes a written file's bytes and size to the device.
pub fn sync_file(f: &File) -> io::Result<()> {
    f.sync_all()
}

/// 16 hex digits from the OS's random source.
fn random_hex() -> io::Result<String> {
    let n = getrandom::u64().map_err(|e| io::Error::other(format!("no random bytes from the OS: {e}")))?;
    Ok(format!("{n:016x}"))
}

enum LockError {
    Held(String),
    Io(io::Error),
}

/// Takes the directory's lock file without waiting, and writes this process's pid into it.
fn lock(dir: &Path) -> Result<File, LockError> {
    let path = dir.join(LOCK_FILE);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(LockError::Io)?;
    if !try_lock(&f).map_err(LockError::Io)? {
        let mut s = String::new();
        let _ = (&f).take(64).read_to_string(&mut s);
        let holder = match s.trim().parse::<u32>() {
            Ok(pid) => format!("pid {pid}"),
            Err(_) => "a process that has not written its pid yet".to_owned(),
        };
        return Err(LockError::Held(holder));
    }
    f.set_len(0).map_err(LockError::Io)?;
    f.write_all(format!("{}\n", std::process::id()).as_bytes()).map_err(LockError::Io)?;
    Ok(f)
}

/// Removes `<prefix>-*` subdirectories of `parent` that this user owns and no live worker
/// holds. Best effort: what cannot be removed stays.
fn sweep_stale(parent: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    let me = rustix::process::geteuid().as_raw();
    let want = format!("{prefix}-");
    for ent in entries.flatten() {
        if !ent.file_name().to_string_lossy().starts_with(&want) {
            continue;
        }
        // symlink_metadata: a planted symlink is not a directory and is left alone.
        let Ok(meta) = std::fs::symlink_metadata(ent.path()) else { continue };
        if !meta.is_dir() || meta.uid() != me {
            continue;
        }
        if let Ok(held) = lock(&ent.path()) {
            let _ = std::fs::remove_dir_all(ent.path());
            drop(held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn a_new_directory_and_its_files_are_private() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("a/b/cache");
        let d = CacheDir::open(&path, "local_disk").unwrap();
        assert_eq!(mode(&path), 0o700);
        assert_eq!(mode(&root.path().join("a")), 0o700, "created parents too");
        assert_eq!(mode(&path.join(LOCK_FILE)), 0o600);
        let (p, mut f) = d.create_temp("x").unwrap();
        f.write_all(b"kv").unwrap();
        sync_file(&f).unwrap();
        assert_eq!(mode(&p), 0o600);
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("x.tmp-") && name.len() == "x.tmp-".len() + 16, "{name}");
        let (q, _) = d.create_temp("x").unwrap();
        assert_ne!(p, q, "names are not reused");
        d.sync().unwrap();
    }

    #[test]
    fn a_symlink_at_the_target_is_refused_and_not_followed() {
        let root = tempfile::tempdir().unwrap();
        let victim = root.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = root.path().join("link");
        symlink(&victim, &link).unwrap();
        let e = create_private(&link).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        // A dangling symlink is not created through either.
        let dangling = root.path().join("dangling");
        symlink(root.path().join("nowhere"), &dangling).unwrap();
        assert!(create_private(&dangling).is_err());
        assert!(!root.path().join("nowhere").exists());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        // A symlink planted as the lock file is not followed.
        let dir = root.path().join("cache");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        symlink(&victim, dir.join(LOCK_FILE)).unwrap();
        let e = CacheDir::open(&dir, "local_disk").unwrap_err().to_string();
        assert!(e.contains("local_disk"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }

    #[test]
    fn a_second_worker_on_the_directory_is_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        let first = CacheDir::open(root.path(), "local_disk").unwrap();
        let e = CacheDir::open(root.path(), "local_disk").unwrap_err();
        assert!(matches!(e, CacheDirError::Busy { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())) && msg.contains("its own local_disk"),
            "{msg}"
        );
        drop(first);
        CacheDir::open(root.path(), "local_disk").expect("free again once the first is gone");
    }

    #[test]
    fn a_directory_others_can_write_or_a_file_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let open = root.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = CacheDir::open(&open, "local_disk").unwrap_err().to_string();
        assert!(e.contains("writable by other users (mode 1777)") && e.contains("chmod go-w"), "{e}");
        // A readable but not writable directory is fine: its files are 0600.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        CacheDir::open(&open, "local_disk").unwrap();
        let file = root.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = CacheDir::open(&file, "local_disk").unwrap_err();
        assert!(matches!(e, CacheDirError::NotADirectory { .. }), "{e}");
    }

    #[test]
    fn unique_subdirectories_share_a_parent_and_stale_ones_are_swept() {
        let root = tempfile::tempdir().unwrap();
        let a = CacheDir::create_unique(root.path(), "flexkv-e", "ssd_cache_dir").unwrap();
        let b = CacheDir::create_unique(root.path(), "flexkv-e", "ssd_cache_dir").unwrap();
        assert_ne!(a.path(), b.path());
        assert_eq!(mode(a.path()), 0o700);
        // A crashed worker's directory: nobody holds its lock.
        let stale = root.path().join("flexkv-e-dead");
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join("x.ssd"), b"old kv").unwrap();
        // Something planted under the prefix that is not a directory of ours stays.
        symlink(root.path(), root.path().join("flexkv-e-link")).unwrap();
        let c = CacheDir::create_unique(root.path(), "flexkv-e", "ssd_cache_dir").unwrap();
        assert!(!stale.exists(), "stale directory swept");
        assert!(a.path().exists() && b.path().exists(), "live workers' directories kept");
        assert!(root.path().join("flexkv-e-link").symlink_metadata().is_ok());
        drop(c);
    }
}

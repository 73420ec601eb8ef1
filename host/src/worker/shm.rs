//! KV regions in POSIX shared memory, so a same-host peer (the nixl connector's `shm`
//! backend) can map the prefill engine's blocks and copy them directly.
//!
//! Segments are created `O_EXCL` with mode 0600 (only this user can map them) and unlinked
//! when the segment is dropped. A process-wide list of live segments lets a signal handler
//! unlink them on SIGTERM/Ctrl-C ([`unlink_live_segments`]), since drops do not run then.

#![allow(unsafe_code)] // Maps and unlinks POSIX shared memory for KV regions.

use crate::worker::error::WorkerError;
use std::collections::BTreeSet;
use std::ffi::CString;
use std::sync::Mutex;
use std::sync::OnceLock;

static LIVE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn live() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    // A panic while holding the lock leaves a set of names that is still correct.
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The segment name for region `index` of engine `engine_id` in this process:
/// `/kvc-<pid>-<random>-<engine_id>-<index>`: `<random>` is 32 random bits chosen once per
/// process, so names cannot be guessed from the pid and the engine id; every character of
/// the engine id outside `[A-Za-z0-9_.-]` is replaced by `_` and the id cut to keep the name
/// short (Linux allows 255 bytes).
pub fn segment_name(engine_id: &str, index: usize) -> String {
    static RANDOM: OnceLock<String> = OnceLock::new();
    let random = RANDOM.get_or_init(|| uuid::Uuid::new_v4().simple().to_string()[..8].to_owned());
    let clean: String = engine_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '_' })
        .take(48)
        .collect();
    format!("/kvc-{}-{random}-{}-{}", std::process::id(), clean, index)
}

/// The pid in a segment name [`segment_name`] made (`kvc-<pid>-...`, with or without `/`).
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.trim_start_matches('/').strip_prefix("kvc-")?;
    let (pid, _) = rest.split_once('-')?;
    pid.parse().ok()
}

/// Unlinks the segments in /dev/shm whose name `keep` refuses; returns how many went.
fn unlink_where(keep: impl Fn(u32) -> bool) -> usize {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return 0 };
    let mut n = 0;
    for e in dir.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if owner_pid(&name).is_some_and(|pid| !keep(pid)) && std::fs::remove_file(e.path()).is_ok() {
            n += 1;
        }
    }
    n
}

/// Unlinks the segments of process `pid` (one that was killed cannot unlink its own).
pub fn remove_segments_of(pid: u32) -> usize {
    unlink_where(|p| p != pid)
}

/// Unlinks the segments whose creating process is gone (a crash or SIGKILL leaves them in
/// /dev/shm, holding memory); returns how many. Workers run it when they start.
pub fn sweep_dead() -> usize {
    unlink_where(process_alive)
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: kill(2) with signal 0 only checks whether the process exists; no memory.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Names of the segments this process has created and not yet unlinked.
pub fn live_segments() -> Vec<String> {
    live().iter().cloned().collect()
}

/// Unlinks every live segment of this process (for SIGTERM/Ctrl-C handlers: mappings stay
/// valid until the process exits, but the names are gone from /dev/shm). Returns how many
/// were unlinked.
pub fn unlink_live_segments() -> usize {
    let names: Vec<String> = std::mem::take(&mut *live()).into_iter().collect();
    let mut n = 0;
    for name in names {
        if let Ok(c) = CString::new(name) {
            // SAFETY: `c` is a valid NUL-terminated string; shm_unlink only reads it.
            if unsafe { libc::shm_unlink(c.as_ptr()) } == 0 {
                n += 1;
            }
        }
    }
    n
}

/// One mapped shared-memory segment, unlinked and unmapped on drop.
#[derive(Debug)]
pub struct ShmSegment {
    name: String,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the segment is plain memory owned by this value; access goes through raw pointers
// and the step protocol, never through shared Rust references, so moving or sharing the
// handle between threads is sound.
unsafe impl Send for ShmSegment {}
// SAFETY: as above; `&ShmSegment` only exposes the address, name and length.
unsafe impl Sync for ShmSegment {}

impl ShmSegment {
    /// Creates, sizes and maps a new segment of `len` bytes (zeroed by the kernel).
    pub fn create(name: &str, len: usize) -> Result<ShmSegment, WorkerError> {
        let err =
            |op: &'static str, source: std::io::Error| WorkerError::Shm { name: name.to_owned(), op, source };
        if live().contains(name) {
            return Err(err(
                "shm_open",
                std::io::Error::new(std::io::ErrorKind::AlreadyExists, "this process already holds a segment of that name (two engines with the same engine_id?)"),
            ));
        }
        let c = CString::new(name).map_err(|_| {
            err("shm_open", std::io::Error::new(std::io::ErrorKind::InvalidInput, "name contains NUL"))
        })?;
        let open = || {
            // SAFETY: `c` is a valid NUL-terminated string; the flags and mode are plain ints.
            unsafe {
                libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600 as libc::mode_t)
            }
        };
        let mut fd = open();
        if fd < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::AlreadyExists {
            // The name carries our pid and no live engine of ours holds it: a leftover of a
            // crashed process that had the same pid. Replace it.
            // SAFETY: valid NUL-terminated string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
            fd = open();
        }
        if fd < 0 {
            return Err(err("shm_open", std::io::Error::last_os_error()));
        }
        let fail = |op: &'static str| {
            let e = std::io::Error::last_os_error();
            // SAFETY: `fd` is the descriptor opened above; `c` a valid string.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(c.as_ptr());
            }
            err(op, e)
        };
        let Ok(off_len) = libc::off_t::try_from(len) else {
            return Err(fail("ftruncate"));
        };
        // SAFETY: `fd` is a valid descriptor we own.
        if unsafe { libc::ftruncate(fd, off_len) } != 0 {
            return Err(fail("ftruncate"));
        }
        // SAFETY: a fresh shared mapping of `len` bytes of `fd`; no existing memory is affected.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(fail("mmap"));
        }
        // SAFETY: the mapping keeps the segment alive; the descriptor is no longer needed.
        unsafe { libc::close(fd) };
        live().insert(name.to_owned());
        Ok(ShmSegment { name: name.to_owned(), ptr: p as *mut u8, len })
    }

    /// The `shm_open` name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Start of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length segment (never created by the pool).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping created in `create`, unmapped once here.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        if live().remove(&self.name) {
            if let Ok(c) = CString::new(self.name.as_str()) {
                // SAFETY: valid NUL-terminated string.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_a_random_part_and_their_owner() {
        let a = segment_name("prefill 0", 3);
        let parts: Vec<&str> = a.trim_start_matches('/').split('-').collect();
        assert_eq!(parts[0], "kvc");
        assert_eq!(parts[1], std::process::id().to_string());
        assert_eq!(parts[2].len(), 8, "{a}");
        assert!(a.ends_with("-prefill_0-3"), "{a}");
        assert_eq!(owner_pid(&a), Some(std::process::id()));
        assert_eq!(owner_pid("kvc-nixl-bench-5"), None);
    }

    #[test]
    fn the_sweep_removes_the_segments_of_dead_processes_only() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let gone = format!("/dev/shm/kvc-{dead}-00000000-sweep-test-0");
        let mine = format!("/dev/shm/kvc-{}-00000000-sweep-test-0", std::process::id());
        std::fs::write(&gone, b"x").unwrap();
        std::fs::write(&mine, b"x").unwrap();
        assert!(sweep_dead() >= 1);
        assert!(!std::path::Path::new(&gone).exists(), "a dead process's segment is removed");
        assert!(std::path::Path::new(&mine).exists(), "a live process's segment stays");
        assert_eq!(remove_segments_of(std::process::id()), 1);
        assert!(!std::path::Path::new(&mine).exists());
    }

    #[test]
    fn create_map_and_unlink_on_drop() {
        let name = segment_name("unit test/ä", 0);
        assert!(name.starts_with("/kvc-") && !name[1..].contains('/'), "{name}");
        let seg = ShmSegment::create(&name, 8192).unwrap();
        assert!(live_segments().contains(&name));
        // SAFETY: the mapping is 8192 bytes long and owned by `seg`.
        unsafe { *seg.ptr().add(8191) = 7 };
        let path = format!("/dev/shm{name}");
        if std::path::Path::new("/dev/shm").exists() {
            use std::os::unix::fs::PermissionsExt;
            let meta = std::fs::metadata(&path).unwrap();
            assert_eq!(meta.permissions().mode() & 0o777, 0o600);
            assert_eq!(meta.len(), 8192);
        }
        let again = ShmSegment::create(&name, 16).unwrap_err().to_string();
        assert!(again.contains("already holds"), "{again}");
        drop(seg);
        assert!(!live_segments().contains(&name));
        assert!(!std::path::Path::new(&path).exists());
    }
}

//! KV regions in POSIX shared memory, so a same-host peer (the nixl connector's `shm`
//! backend) can map the prefill engine's blocks and copy them directly: the names this
//! process gives its segments and the sweeps of segments whose process is gone. The segment
//! itself ([`ShmSegment`], created `O_EXCL` with mode 0600, unlinked on drop or by
//! [`unlink_live_segments`] from a signal handler) is `kvconnect-dataplane`'s, whose
//! mappings the connectors' consumers open.

#![allow(unsafe_code)] // kill(2) with signal 0: is the process that created a segment alive?

use crate::EngineError;
use std::sync::OnceLock;

pub use kvconnect_dataplane::shm::{live_segments, unlink_live_segments, ShmSegment};

/// The segment name for region `index` of engine `engine_id` in this process:
/// `/kvc-<pid>-<random>-<engine_id>-<index>`: `<random>` is 128 bits from the OS's random
/// number generator (32 hex digits), chosen once per process, so names cannot be guessed from
/// the pid and the engine id; every character of the engine id outside `[A-Za-z0-9_.-]` is
/// replaced by `_` and the id cut to keep the name short (Linux allows 255 bytes).
pub fn segment_name(engine_id: &str, index: usize) -> Result<String, EngineError> {
    static RANDOM: OnceLock<Result<String, String>> = OnceLock::new();
    let random =
        RANDOM.get_or_init(|| kvconnect_dataplane::auth::random_hex::<16>().map_err(|e| e.to_string()));
    let random = random.as_ref().map_err(|e| EngineError::Shm {
        name: format!("/kvc-{}-...", std::process::id()),
        op: "choosing a random name (getrandom)",
        source: std::io::Error::other(e.clone()),
    })?;
    let clean: String = engine_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '_' })
        .take(48)
        .collect();
    Ok(format!("/kvc-{}-{random}-{}-{}", std::process::id(), clean, index))
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
/// /dev/shm, holding memory); returns how many. Servers run it when they start.
pub fn sweep_dead() -> usize {
    unlink_where(process_alive)
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: kill(2) with signal 0 only checks whether the process exists; no memory.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_a_random_part_and_their_owner() {
        let a = segment_name("prefill 0", 3).unwrap();
        let parts: Vec<&str> = a.trim_start_matches('/').split('-').collect();
        assert_eq!(parts[0], "kvc");
        assert_eq!(parts[1], std::process::id().to_string());
        assert_eq!(parts[2].len(), 32, "128 random bits, hex: {a}");
        assert!(parts[2].bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_eq!(
            segment_name("prefill 0", 4).unwrap().split('-').nth(2),
            Some(parts[2]),
            "once per process"
        );
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
        let name = segment_name("unit test/ä", 0).unwrap();
        assert!(name.starts_with("/kvc-") && !name[1..].contains('/'), "{name}");
        let seg = ShmSegment::create_replacing(&name, 8192).unwrap();
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
        let again = ShmSegment::create_replacing(&name, 16).unwrap_err().to_string();
        assert!(again.contains("already holds"), "{again}");
        drop(seg);
        assert!(!live_segments().contains(&name));
        assert!(!std::path::Path::new(&path).exists());
    }
}

//! POSIX shared memory: a consumer's read-only view of a producer's KV region
//! ([`ShmMapping`]), and the segment that backs one ([`ShmSegment`]): the host pool's KV
//! regions and the test harness's. Segments are created `O_EXCL` with mode 0600 (only this
//! user can map them) and unlinked when dropped; a process-wide list of live segments lets a
//! signal handler unlink them ([`unlink_live_segments`]), since drops do not run then.

#![allow(unsafe_code)] // Shared memory: shm_open, mmap and slices of the mapping.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io;
use std::sync::Mutex;

/// Why a segment could not be opened or created.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A name with a NUL byte, or not starting with '/'.
    #[error("shared memory name {0:?} is invalid: it must start with '/' and contain no NUL or further '/'")]
    BadName(String),
    /// A libc call failed.
    #[error("shared memory segment '{name}': {op} failed: {source}")]
    Os {
        /// The segment.
        name: String,
        /// The call.
        op: &'static str,
        /// errno.
        source: io::Error,
    },
    /// The segment's size is not what the peer's metadata says.
    #[error(
        "shared memory segment '{name}' is {actual} bytes but the peer's metadata says {expected}: it is \
        not the region the peer registered (stale segment or a restarted peer); redo the handshake"
    )]
    SizeMismatch {
        /// The segment.
        name: String,
        /// Its size.
        actual: u64,
        /// The metadata's.
        expected: u64,
    },
    /// Other users may read or write it.
    #[error(
        "shared memory segment '{name}' has mode {mode:o} or another owner: KV regions must be created \
        with mode 0600 by this user"
    )]
    NotPrivate {
        /// The segment.
        name: String,
        /// Its mode bits.
        mode: u32,
    },
}

fn c_name(name: &str) -> Result<CString, ShmError> {
    if !name.starts_with('/') || name.len() < 2 || name[1..].contains('/') {
        return Err(ShmError::BadName(name.to_owned()));
    }
    CString::new(name).map_err(|_| ShmError::BadName(name.to_owned()))
}

fn os(name: &str, op: &'static str) -> ShmError {
    ShmError::Os { name: name.to_owned(), op, source: io::Error::last_os_error() }
}

/// A read-only mapping of another process's segment.
#[derive(Debug)]
pub struct ShmMapping {
    name: String,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only shared memory owned by this value; reading it from any
// thread is as safe as reading it from one (the producer's writes are ordered by the
// hold/done protocol, not by Rust).
unsafe impl Send for ShmMapping {}
// SAFETY: as above; `&ShmMapping` only hands out reads.
unsafe impl Sync for ShmMapping {}

impl ShmMapping {
    /// Maps `name` read-only (`shm_open O_RDONLY` + `mmap PROT_READ`), refusing a segment
    /// whose size differs from `expected_len` or that other users can open.
    pub fn open(name: &str, expected_len: u64) -> Result<ShmMapping, ShmError> {
        let c = c_name(name)?;
        // SAFETY: `c` is a valid NUL-terminated string; shm_open does not keep the pointer.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0) };
        if fd < 0 {
            return Err(os(name, "shm_open"));
        }
        let result = (|| {
            // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `fd` is open and `st` is a valid out-pointer.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(os(name, "fstat"));
            }
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            let mode = st.st_mode as u32 & 0o777;
            if mode & 0o077 != 0 || st.st_uid != me {
                return Err(ShmError::NotPrivate { name: name.to_owned(), mode });
            }
            let actual = st.st_size as u64;
            if actual != expected_len {
                return Err(ShmError::SizeMismatch { name: name.to_owned(), actual, expected: expected_len });
            }
            let len = usize::try_from(actual).map_err(|_| ShmError::SizeMismatch {
                name: name.to_owned(),
                actual,
                expected: expected_len,
            })?;
            if len == 0 {
                return Ok(ShmMapping {
                    name: name.to_owned(),
                    ptr: std::ptr::NonNull::dangling().as_ptr(),
                    len,
                });
            }
            // SAFETY: mapping `len` bytes of an open fd read-only and shared; the kernel picks
            // the address; the result is checked for MAP_FAILED. No MAP_POPULATE: a producer's
            // whole KV cache (an engine's, gigabytes) would be mapped page by page inside the
            // first pull, which on a busy core outlasted the producer's lease; a pull instead
            // faults in only the pages of the blocks it reads, once.
            let p =
                unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
            if p == libc::MAP_FAILED {
                return Err(os(name, "mmap"));
            }
            Ok(ShmMapping { name: name.to_owned(), ptr: p as *const u8, len })
        })();
        // SAFETY: `fd` is ours; the mapping (if any) stays valid after close.
        unsafe { libc::close(fd) };
        result
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives (munmap in Drop).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmapping exactly the range mmap returned; no slice of it outlives self.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

/// The segments this process created and has not unlinked: a signal handler unlinks them
/// ([`unlink_live_segments`]), since drops do not run on SIGTERM/Ctrl-C.
static LIVE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn live() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    // A panic while holding the lock leaves a set of names that is still correct.
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
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

/// Every page size Linux uses for these mappings divides this.
const PAGE_GRAIN: usize = 2 << 20;
/// Below this many bytes per thread, populating a segment is not split between threads.
const POPULATE_PIECE: usize = 256 << 20;
/// The most threads populating one segment.
const POPULATE_THREADS: usize = 16;

/// Allocates the memory of the fresh shared mapping `[ptr, ptr + len)` of `fd` now and maps
/// every page of it writable (`MADV_POPULATE_WRITE`), as writing zeros over a private buffer
/// does: an engine's first write into each page of its KV cache then costs no page fault (on
/// a VM about 0.8 µs per KiB, 0.4 ms for a fresh 512 KiB of blocks), and a `/dev/shm` too
/// small for the segment fails here, with this error, instead of killing the process with
/// SIGBUS at some later write. A large segment is populated by several threads at once, in
/// pieces of at least [`POPULATE_PIECE`], as an engine's zeroing of its KV cache runs on its
/// threads (about 1.5 s per GiB on one thread of a busy VM). A kernel older than 5.14 has no
/// such advice: the segment's memory is then allocated (`posix_fallocate`), which checks the
/// room, and mapped as it is first written.
fn populate(fd: libc::c_int, ptr: *mut u8, len: usize, name: &str) -> Result<(), ShmError> {
    populate_in_pieces(fd, ptr, len, name, POPULATE_PIECE)
}

/// [`populate`], split between threads in pieces of at least `min_piece` bytes.
fn populate_in_pieces(
    fd: libc::c_int,
    ptr: *mut u8,
    len: usize,
    name: &str,
    min_piece: usize,
) -> Result<(), ShmError> {
    if len == 0 {
        return Ok(());
    }
    let no_room = |source: io::Error| ShmError::Os {
        name: name.to_owned(),
        op: "allocating its memory",
        source: io::Error::new(
            source.kind(),
            format!("{source}: /dev/shm has no room for {len} more bytes (its tmpfs is full or smaller)"),
        ),
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(POPULATE_THREADS)
        .min(len / min_piece.max(1))
        .max(1);
    // Whole pages per thread: `ptr` is page-aligned, and so is every piece's start.
    let piece = len.div_ceil(threads).next_multiple_of(PAGE_GRAIN);
    // The address as a number, which threads may share (a raw pointer may not).
    let base = ptr as usize;
    let advise = |start: usize| -> Result<(), io::Error> {
        let n = piece.min(len - start);
        // SAFETY: `[ptr + start, + n)` lies in the shared mapping of `fd` the caller made; the
        // advice only faults its pages in, as writes would, without changing their contents.
        let r = unsafe { libc::madvise((base + start) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    let starts: Vec<usize> = (0..len).step_by(piece).collect();
    let results: Vec<Result<(), io::Error>> = if starts.len() == 1 {
        vec![advise(0)]
    } else {
        std::thread::scope(|s| {
            // A piece whose thread cannot be started is populated on this one, after the others
            // started.
            let spawned: Vec<_> = starts
                .iter()
                .map(|&o| (o, std::thread::Builder::new().spawn_scoped(s, move || advise(o))))
                .collect();
            spawned
                .into_iter()
                .map(|(o, h)| match h {
                    Ok(h) => {
                        h.join().unwrap_or_else(|_| Err(io::Error::other("a populating thread panicked")))
                    }
                    Err(_) => advise(o),
                })
                .collect()
        })
    };
    let Some(err) = results.into_iter().find_map(Result::err) else { return Ok(()) };
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(no_room(err));
    }
    let off_len = libc::off_t::try_from(len).unwrap_or(libc::off_t::MAX);
    // SAFETY: `fd` is open for writing; posix_fallocate returns its error instead of setting errno.
    match unsafe { libc::posix_fallocate(fd, 0, off_len) } {
        0 => Ok(()),
        e => Err(no_room(io::Error::from_raw_os_error(e))),
    }
}

/// A shared-memory segment this process created (mode 0600, `O_EXCL`), mapped read-write,
/// unlinked and unmapped on drop: the host pool's KV regions and the test harness's.
#[derive(Debug)]
pub struct ShmSegment {
    name: String,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the segment is plain memory owned by this value; access goes through raw pointers
// (the step protocol orders the engine's and the connectors' turns), never through shared
// Rust references, so moving or sharing the handle between threads is sound.
unsafe impl Send for ShmSegment {}
// SAFETY: as above; `&ShmSegment` only exposes the address, name and length.
unsafe impl Sync for ShmSegment {}

impl ShmSegment {
    /// Creates `name` with `len` zeroed bytes (zeroed by the kernel); fails if it exists.
    pub fn create(name: &str, len: usize) -> Result<ShmSegment, ShmError> {
        ShmSegment::create_inner(name, len, false)
    }

    /// As [`ShmSegment::create`], but a segment of that name that no segment of this process
    /// holds is taken for a leftover and replaced: for names that carry this process's pid,
    /// whose earlier owner (a crashed process with the same pid) cannot be alive.
    pub fn create_replacing(name: &str, len: usize) -> Result<ShmSegment, ShmError> {
        ShmSegment::create_inner(name, len, true)
    }

    fn create_inner(name: &str, len: usize, replace: bool) -> Result<ShmSegment, ShmError> {
        // SAFETY: no fixed address: the kernel picks one.
        unsafe { ShmSegment::create_at(name, len, replace, None, false) }
    }

    /// As [`ShmSegment::create_inner`]; with `at`, the segment is mapped there, over what was
    /// mapped (`MAP_FIXED`); with `populate`, its memory is allocated and mapped now
    /// ([`populate`]).
    ///
    /// # Safety
    /// With `at`: `[at, at + len)` is page-aligned, mapped by the caller, and nothing reads or
    /// writes it through another mapping while this segment replaces it; the segment unmaps
    /// it when dropped.
    unsafe fn create_at(
        name: &str,
        len: usize,
        replace: bool,
        at: Option<*mut u8>,
        populate_now: bool,
    ) -> Result<ShmSegment, ShmError> {
        if live().contains(name) {
            return Err(ShmError::Os {
                name: name.to_owned(),
                op: "shm_open",
                source: io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "this process already holds a segment of that name (two \
                     engines with the same engine_id?)",
                ),
            });
        }
        let c = c_name(name)?;
        let open = || {
            // SAFETY: `c` is a valid NUL-terminated string; O_EXCL so an existing segment is
            // never taken over.
            unsafe {
                libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600 as libc::mode_t)
            }
        };
        let mut fd = open();
        if fd < 0 && replace && io::Error::last_os_error().kind() == io::ErrorKind::AlreadyExists {
            // SAFETY: valid NUL-terminated string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
            fd = open();
        }
        if fd < 0 {
            return Err(os(name, "shm_open"));
        }
        let result = (|| {
            let off_len = libc::off_t::try_from(len).map_err(|_| ShmError::Os {
                name: name.to_owned(),
                op: "ftruncate",
                source: io::Error::new(io::ErrorKind::InvalidInput, format!("{len} bytes do not fit off_t")),
            })?;
            // SAFETY: `fd` is open for writing.
            if unsafe { libc::ftruncate(fd, off_len) } != 0 {
                return Err(os(name, "ftruncate"));
            }
            let (addr, fixed) = match at {
                Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED),
                None => (std::ptr::null_mut(), 0),
            };
            // SAFETY: a fresh shared mapping of an open fd of at least `len` bytes (one byte
            // for an empty segment); checked for MAP_FAILED. With MAP_FIXED, the caller
            // vouched for the range (create_at's contract).
            let p = unsafe {
                libc::mmap(
                    addr,
                    len.max(1),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | fixed,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(os(name, "mmap"));
            }
            if populate_now {
                if let Err(e) = populate(fd, p as *mut u8, len, name) {
                    if at.is_none() {
                        // SAFETY: unmapping the mapping made just above, which nothing has seen.
                        // With `at`, the range stays mapped: it is the caller's.
                        unsafe { libc::munmap(p, len.max(1)) };
                    }
                    return Err(e);
                }
            }
            Ok(p as *mut u8)
        })();
        // SAFETY: `fd` is ours; the mapping keeps the segment alive without it.
        unsafe { libc::close(fd) };
        match result {
            Ok(ptr) => {
                live().insert(name.to_owned());
                Ok(ShmSegment { name: name.to_owned(), ptr, len })
            }
            Err(e) => {
                // SAFETY: removing the name we just created.
                unsafe { libc::shm_unlink(c.as_ptr()) };
                Err(e)
            }
        }
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

    /// True for a zero-length segment.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        // SAFETY: `ptr` and the mapped length are exactly what `create` mapped, unmapped once
        // here.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) };
        // A signal handler may have unlinked it already (unlink_live_segments).
        if live().remove(&self.name) {
            if let Ok(c) = CString::new(self.name.as_str()) {
                // SAFETY: valid NUL-terminated string.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
        }
    }
}

/// One contiguous, zeroed buffer of this process whose page-aligned slabs are shared-memory
/// segments (the rest private memory): for an engine that allocates its whole KV cache at
/// once and views each layer's part of it, so every layer's region is one segment a same-host
/// peer maps by name. The segments' memory is allocated and mapped when the arena is made
/// ([`populate`]), as zeroing a private buffer of that size would. Unmapped, and its segments
/// unlinked, when dropped.
#[derive(Debug)]
pub struct ShmArena {
    ptr: *mut u8,
    len: usize,
    /// Dropped (unmapped, unlinked) before the reservation is unmapped.
    segments: Vec<(usize, ShmSegment)>,
}

// SAFETY: as for ShmSegment: plain memory owned by this value, reached through raw pointers.
unsafe impl Send for ShmArena {}
// SAFETY: as above; `&ShmArena` only exposes addresses and names.
unsafe impl Sync for ShmArena {}

/// Why an arena's slabs cannot be laid out.
fn bad_slab(name: &str, reason: String) -> ShmError {
    ShmError::Os {
        name: name.to_owned(),
        op: "arena",
        source: io::Error::new(io::ErrorKind::InvalidInput, reason),
    }
}

impl ShmArena {
    /// `len` zeroed bytes in which each `(offset, len)` slab is a segment named by `name(i)`
    /// for the `i`-th distinct slab. Slabs listed twice (engines alias one range from two
    /// views) are one segment; slabs must be page-aligned, inside the buffer and must not
    /// overlap otherwise.
    pub fn create(
        len: usize,
        slabs: &[(usize, usize)],
        name: impl Fn(usize) -> String,
    ) -> Result<ShmArena, ShmError> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
        let mut distinct: Vec<(usize, usize)> = slabs.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let label = "KV arena";
        for w in distinct.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(bad_slab(
                    label,
                    format!("slabs {:?} and {:?} overlap without being the same range", w[0], w[1]),
                ));
            }
        }
        for &(off, l) in &distinct {
            if off % page != 0 || l % page != 0 || l == 0 || off.checked_add(l).is_none_or(|e| e > len) {
                return Err(bad_slab(
                    label,
                    format!(
                        "slab of {l} bytes at {off} is empty, not aligned to the {page}-byte page or \
                        outside the {len}-byte buffer"
                    ),
                ));
            }
        }
        // SAFETY: a fresh private anonymous mapping (zeroed); the kernel picks the address;
        // checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os(label, "mmap"));
        }
        let mut arena = ShmArena { ptr: p as *mut u8, len, segments: Vec::with_capacity(distinct.len()) };
        for (i, &(off, l)) in distinct.iter().enumerate() {
            // SAFETY: `[ptr + off, + l)` is page-aligned and inside the mapping this arena just
            // made, which nothing else has seen yet; the segment replaces that part of it.
            let seg = unsafe { ShmSegment::create_at(&name(i), l, true, Some(arena.ptr.add(off)), true) }?;
            arena.segments.push((off, seg));
        }
        Ok(arena)
    }

    /// Start of the buffer.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The segment that is exactly `[addr, addr + len)`, by name.
    pub fn segment_at(&self, addr: u64, len: u64) -> Option<&str> {
        let base = self.ptr as u64;
        self.segments
            .iter()
            .find(|(off, s)| base + *off as u64 == addr && s.len() as u64 == len)
            .map(|(_, s)| s.name())
    }

    /// The segments' names.
    pub fn names(&self) -> Vec<String> {
        self.segments.iter().map(|(_, s)| s.name().to_owned()).collect()
    }
}

impl Drop for ShmArena {
    fn drop(&mut self) {
        self.segments.clear();
        // SAFETY: unmapping exactly the range create mapped (the segments' parts of it are
        // already unmapped, which munmap allows).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_map_read_only_and_check_size() {
        let name = format!("/kvc-nixl-test-{}-a", std::process::id());
        let seg = ShmSegment::create(&name, 4096).unwrap();
        // SAFETY: the segment is 4096 bytes and only this test touches it.
        unsafe { std::ptr::write_bytes(seg.ptr(), 7, 4096) };
        let m = ShmMapping::open(&name, 4096).unwrap();
        assert!(m.as_slice().iter().all(|b| *b == 7));
        let e = ShmMapping::open(&name, 8192).unwrap_err();
        assert!(matches!(e, ShmError::SizeMismatch { actual: 4096, .. }), "{e}");
        drop(m);
        drop(seg);
        assert!(ShmMapping::open(&name, 4096).is_err(), "unlinked on drop");
        assert!(matches!(ShmMapping::open("no-slash", 1), Err(ShmError::BadName(_))));
    }

    #[test]
    fn an_arena_maps_its_slabs_as_segments_and_the_rest_as_private_memory() {
        let base = format!("/kvc-nixl-test-{}-arena", std::process::id());
        let name = |i: usize| format!("{base}-{i}");
        let page = 4096;
        // Two views of the first slab (aliased), a second slab, a private gap between them.
        let a = ShmArena::create(4 * page, &[(0, page), (2 * page, 2 * page), (0, page)], name).unwrap();
        assert_eq!(a.names(), [name(0), name(1)]);
        // SAFETY: the arena is 4 pages, only this test touches it.
        let all = unsafe { std::slice::from_raw_parts_mut(a.ptr(), 4 * page) };
        assert!(all.iter().all(|b| *b == 0), "zeroed");
        all[..page].fill(1);
        all[page..2 * page].fill(2);
        all[2 * page..].fill(3);
        let m0 = ShmMapping::open(&name(0), page as u64).unwrap();
        let m1 = ShmMapping::open(&name(1), 2 * page as u64).unwrap();
        assert!(m0.as_slice().iter().all(|b| *b == 1));
        assert!(m1.as_slice().iter().all(|b| *b == 3), "a peer sees the arena's writes");
        let base_addr = a.ptr() as u64;
        assert_eq!(a.segment_at(base_addr + 2 * page as u64, 2 * page as u64), Some(name(1).as_str()));
        assert_eq!(a.segment_at(base_addr + page as u64, page as u64), None, "the gap is private");
        drop((m0, m1, a));
        assert!(ShmMapping::open(&name(0), page as u64).is_err(), "unlinked on drop");
        for bad in [vec![(0, page), (page / 2, page)], vec![(100, page)], vec![(3 * page, 2 * page)]] {
            let e = ShmArena::create(4 * page, &bad, name).unwrap_err().to_string();
            assert!(e.contains("overlap") || e.contains("aligned"), "{bad:?}: {e}");
        }
    }

    /// How many of the pages of `[ptr, ptr + len)` this process has mapped (`/proc/self/pagemap`,
    /// whose present bit needs no privilege).
    fn pages_mapped(ptr: *mut u8, len: usize) -> usize {
        use std::io::{Read, Seek, SeekFrom};
        let page = 4096;
        let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
        f.seek(SeekFrom::Start((ptr as u64 / page as u64) * 8)).unwrap();
        let mut buf = vec![0u8; len / page * 8];
        f.read_exact(&mut buf).unwrap();
        buf.chunks_exact(8).filter(|e| u64::from_le_bytes((*e).try_into().unwrap()) >> 63 == 1).count()
    }

    #[test]
    fn an_arenas_segments_are_allocated_and_mapped_when_made() {
        let base = format!("/kvc-nixl-test-{}-arena-populated", std::process::id());
        let page = 4096;
        let a = ShmArena::create(64 * page, &[(0, 32 * page)], |i| format!("{base}-{i}")).unwrap();
        assert_eq!(pages_mapped(a.ptr(), 32 * page), 32, "the segment's pages are mapped before any write");
        // SAFETY: the arena's second half is its private part, 32 pages, untouched so far.
        let private = unsafe { a.ptr().add(32 * page) };
        assert_eq!(pages_mapped(private, 32 * page), 0, "the private rest is left as it was");
        let plain = ShmSegment::create(&format!("{base}-plain"), 8 * page).unwrap();
        assert_eq!(pages_mapped(plain.ptr(), 8 * page), 0, "other segments fault in as they are used");
        // A segment populated by several threads, in pieces of 2 MiB.
        let big = ShmSegment::create(&format!("{base}-big"), 8 << 20).unwrap();
        populate_in_pieces(-1, big.ptr(), 8 << 20, big.name(), 2 << 20).unwrap();
        assert_eq!(pages_mapped(big.ptr(), 8 << 20), (8 << 20) / page, "every piece populated");
    }

    /// In a mount namespace of its own whose /dev/shm is a 64 KiB tmpfs (as root, with
    /// `unshare`; skipped otherwise): an arena larger than that fails when made, naming the
    /// room, instead of dying of SIGBUS at a later write.
    #[test]
    fn an_arena_larger_than_dev_shm_fails_when_made() {
        const CHILD: &str = "KVCONNECT_TEST_SMALL_DEV_SHM";
        if std::env::var_os(CHILD).is_some() {
            let e = ShmArena::create(64 * 4096, &[(0, 64 * 4096)], |_| "/kvc-nixl-test-too-big".into())
                .unwrap_err()
                .to_string();
            assert!(e.contains("/dev/shm has no room for 262144 more bytes"), "{e}");
            assert!(ShmMapping::open("/kvc-nixl-test-too-big", 1).is_err(), "the failed segment is unlinked");
            // Populated by several threads, the pieces past the room fail the whole.
            let seg = ShmSegment::create("/kvc-nixl-test-too-big-pieces", 8 << 20).unwrap();
            let e = populate_in_pieces(-1, seg.ptr(), 8 << 20, seg.name(), 2 << 20).unwrap_err().to_string();
            assert!(e.contains("/dev/shm has no room for 8388608 more bytes"), "{e}");
            return;
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting a small /dev/shm needs root");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        // Exit status 77: no mount namespace of its own here (a container without the right).
        let script =
            "mount -t tmpfs -o size=64k tmpfs /dev/shm || exit 77; exec \"$0\" --exact \"$1\" --nocapture";
        let out = std::process::Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c", script])
            .arg(&exe)
            .arg("shm::tests::an_arena_larger_than_dev_shm_fails_when_made")
            .env(CHILD, "1")
            .output();
        let out = match out {
            Ok(o) => o,
            Err(e) => return eprintln!("skipped: cannot run unshare: {e}"),
        };
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.code() == Some(77) || (text.starts_with("unshare:") && text.contains("not permitted")) {
            return eprintln!("skipped: no mount namespace of this test's own: {}", text.trim());
        }
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
    }
}

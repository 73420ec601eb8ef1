//! The memory behind one KV region: zeroed, page-aligned host memory (on transparent huge
//! pages where the kernel gives them), or a shared-memory segment. The address never moves while the value lives, because connectors hold it.

#![allow(unsafe_code)] // Maps and unmaps the host memory behind KV regions.

use crate::error::EngineError;
use crate::shm::ShmSegment;

const ALIGN: usize = 4096;

/// Backing memory of a region.
#[derive(Debug)]
pub enum RegionMemory {
    /// Private host memory.
    Heap {
        /// Start.
        ptr: *mut u8,
        /// Length.
        len: usize,
        /// Bytes mapped from `ptr` (`len` rounded up to a page).
        mapped: usize,
    },
    /// A POSIX shared-memory segment.
    Shm(ShmSegment),
}

// SAFETY: the memory is owned by this value and reached only through raw pointers under the
// step protocol (the engine and the connectors never touch the same block at once).
unsafe impl Send for RegionMemory {}
// SAFETY: as above.
unsafe impl Sync for RegionMemory {}

/// Transparent huge pages are this large on x86_64 and aarch64 with 4 KiB pages: a heap
/// region at least this long is aligned to it and advised for them.
pub const HUGE_PAGE: usize = 2 << 20;

impl RegionMemory {
    /// `len` zeroed bytes of private host memory, on transparent huge pages where the kernel
    /// gives them (`MADV_HUGEPAGE`; `/sys/kernel/mm/transparent_hugepage/enabled` set to
    /// `always` or `madvise`): fewer page faults on first touch and fewer TLB misses in the
    /// copies. Elsewhere the advice does nothing and the pages are ordinary ones.
    pub fn heap(name: &str, len: usize) -> Result<RegionMemory, EngineError> {
        Self::heap_with(name, len, true)
    }

    /// [`RegionMemory::heap`], advised for huge pages or not (`huge`; the benchmark's
    /// baseline).
    pub fn heap_with(name: &str, len: usize, huge: bool) -> Result<RegionMemory, EngineError> {
        let alloc_err = || EngineError::Alloc { name: name.to_owned(), bytes: len };
        let asked = len;
        let len = len.max(1);
        // Whole pages, and whole huge pages past the first so the advice covers every one.
        let align = if huge && len >= HUGE_PAGE { HUGE_PAGE } else { ALIGN };
        let map_len = len.checked_add(align - 1).ok_or_else(alloc_err)? / ALIGN * ALIGN + align;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing: no
        // existing memory is touched; the result is checked against MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(alloc_err());
        }
        let start = (base as usize).next_multiple_of(align);
        let end = (start + len).next_multiple_of(ALIGN);
        // SAFETY: [base, start) and [end, base + map_len) are page-aligned parts of the
        // mapping just made, outside the region; nothing points into them.
        unsafe {
            if start > base as usize {
                libc::munmap(base, start - base as usize);
            }
            if base as usize + map_len > end {
                libc::munmap(end as *mut libc::c_void, base as usize + map_len - end);
            }
        }
        if align == HUGE_PAGE {
            // SAFETY: advice on the region's own mapping, before any page of it is touched. A
            // kernel without transparent huge pages refuses it (EINVAL): ordinary pages then.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
        Ok(RegionMemory::Heap { ptr: start as *mut u8, len: asked, mapped: end - start })
    }

    /// `len` zeroed bytes in a new shared-memory segment called `shm_name`.
    pub fn shm(shm_name: &str, len: usize) -> Result<RegionMemory, EngineError> {
        Ok(RegionMemory::Shm(ShmSegment::create_replacing(shm_name, len.max(1))?))
    }

    /// Start address.
    pub fn ptr(&self) -> *mut u8 {
        match self {
            RegionMemory::Heap { ptr, .. } => *ptr,
            RegionMemory::Shm(s) => s.ptr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            RegionMemory::Heap { len, .. } => *len,
            RegionMemory::Shm(s) => s.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The segment name when in shared memory.
    pub fn shm_name(&self) -> Option<&str> {
        match self {
            RegionMemory::Heap { .. } => None,
            RegionMemory::Shm(s) => Some(s.name()),
        }
    }
}

impl Drop for RegionMemory {
    fn drop(&mut self) {
        if let RegionMemory::Heap { ptr, mapped, .. } = *self {
            // SAFETY: [ptr, ptr + mapped) is exactly what `heap_with` kept mapped, and the
            // connectors that held its address were shut down before the region is dropped.
            unsafe { libc::munmap(ptr as *mut libc::c_void, mapped) };
        }
    }
}

/// Host memory allocated as KV regions are ([`RegionMemory::heap`], on huge pages where the
/// kernel gives them) but never registered with a connector, so it is safe to borrow as
/// bytes: the buffers of the benchmarks' baselines, which must be as well placed as the
/// regions they are compared with.
/// (Send and Sync as `RegionMemory` is: the memory is owned by this value alone.)
#[derive(Debug)]
pub struct HostBuffer(RegionMemory);

impl HostBuffer {
    /// `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Result<HostBuffer, EngineError> {
        RegionMemory::heap("buffer", len).map(HostBuffer).map_err(|_| EngineError::BufferAlloc { bytes: len })
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped for this value alone (never handed to a connector), alive
        // while it is; the borrow of `self` keeps writers away.
        unsafe { std::slice::from_raw_parts(self.0.ptr(), self.0.len()) }
    }

    /// The bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, with the exclusive borrow of `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr(), self.0.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this kernel gives transparent huge pages to memory advised for them.
    fn thp_advised() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
    }

    /// `AnonHugePages` of the mapping holding `addr`, in KiB, from /proc/self/smaps.
    fn anon_huge_kib(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = a <= addr && addr < b;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(v) = line.strip_prefix("AnonHugePages:") {
                    return v.trim().trim_end_matches("kB").trim().parse().ok();
                }
            }
        }
        None
    }

    #[test]
    fn a_buffer_too_large_to_map_says_so_and_what_to_do() {
        let e = HostBuffer::zeroed(usize::MAX / 2).unwrap_err().to_string();
        assert!(e.contains("cannot allocate") && e.contains("move fewer bytes"), "{e}");
        let e = RegionMemory::heap("layer.0", usize::MAX - 8).unwrap_err().to_string();
        assert!(e.contains("KV region 'layer.0'") && e.contains("lower num_blocks"), "{e}");
    }

    #[test]
    fn heap_regions_are_zeroed_aligned_and_exactly_as_long_as_asked() {
        for (len, huge) in
            [(0usize, true), (1, true), (5000, true), (HUGE_PAGE + 4096 + 3, true), (3 * HUGE_PAGE, false)]
        {
            let m = RegionMemory::heap_with("t", len, huge).unwrap();
            assert_eq!(m.len(), len);
            let align = if huge && len >= HUGE_PAGE { HUGE_PAGE } else { ALIGN };
            assert_eq!(m.ptr() as usize % align, 0, "len {len}");
            // SAFETY: the region is `len` bytes of this test's own mapping.
            let bytes = unsafe { std::slice::from_raw_parts_mut(m.ptr(), len) };
            assert!(bytes.iter().all(|b| *b == 0));
            bytes.fill(7);
        }
    }

    #[test]
    fn a_large_heap_region_gets_huge_pages_where_the_kernel_gives_them() {
        if !thp_advised() {
            eprintln!("skipped: transparent huge pages are off on this kernel");
            return;
        }
        let m = RegionMemory::heap("t", 8 * HUGE_PAGE).unwrap();
        // SAFETY: the region is this test's own mapping.
        unsafe { std::ptr::write_bytes(m.ptr(), 1, m.len()) };
        let kib = anon_huge_kib(m.ptr() as usize).expect("the region's mapping is in /proc/self/smaps");
        // The kernel may fall back to small pages where memory is fragmented, not everywhere.
        assert!(kib >= 2048, "no huge page in an advised 16 MiB region ({kib} KiB)");
        let plain = RegionMemory::heap_with("t", 8 * HUGE_PAGE, false).unwrap();
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(plain.ptr(), 1, plain.len()) };
        if std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[madvise]"))
        {
            assert_eq!(anon_huge_kib(plain.ptr() as usize), Some(0), "huge pages without the advice");
        }
    }
}

//! Host memory placed for bulk copies: zeroed, page-aligned anonymous mappings, on
//! transparent huge pages where the kernel gives them. The engine's KV regions, the cache
//! tiers' slots and the benchmarks' baseline buffers are all allocated here, so that a
//! subject and its baseline sit on the same kind of pages.

#![allow(unsafe_code)] // Maps and unmaps anonymous memory, and views it as bytes.

/// The page size mappings are rounded to.
pub const PAGE: usize = 4096;

/// Transparent huge pages are this large on x86_64 and aarch64 with 4 KiB pages: a buffer at
/// least this long is aligned to it and advised for them.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the whole huge pages inside `memory` with huge pages, for memory
/// that is not a [`HostBuffer`] (a large `Vec` the allocator mapped, such as the router's
/// tables): a random probe of hundreds of MiB then costs no page walk of 4 KiB pages, and
/// first touch one fault per 2 MiB instead of per 4 KiB. A hint: it changes no byte; memory
/// shorter than a huge page, or a kernel without transparent huge pages, is left as it is.
/// Call it before the memory is first written, or the pages already backed stay small until
/// the kernel's background collapse reaches them.
pub fn advise_huge_pages<T: Copy>(memory: &mut [T]) {
    let start = memory.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(memory);
    let (first, last) = (start.next_multiple_of(HUGE_PAGE), end / HUGE_PAGE * HUGE_PAGE);
    if last > first {
        advise_huge(first, last);
    }
}

/// `MADV_HUGEPAGE` on `[start, end)`, page-aligned and inside memory the caller owns. A kernel
/// without transparent huge pages refuses it (EINVAL): ordinary pages then.
fn advise_huge(start: usize, end: usize) {
    // SAFETY: advice on memory its caller owns (a mapping just made, or a slice it borrows
    // mutably), page-aligned; MADV_HUGEPAGE changes how the kernel backs those pages, never
    // their contents, so no reference into them is invalidated.
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
}

/// Host memory could not be mapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot allocate {bytes} bytes of host memory ({reason}): free memory, or ask for less")]
pub struct AllocError {
    /// Bytes asked for.
    pub bytes: usize,
    /// What the kernel said.
    pub reason: String,
}

/// `len` zeroed bytes of private host memory, owned by this value. The address never moves
/// while the value lives.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    /// Bytes mapped from `ptr` (`len` rounded up to a page).
    mapped: usize,
}

// SAFETY: the mapping is owned by this value alone, as a Vec's heap buffer is by the Vec;
// shared access gives only `&[u8]`, and writers need `&mut self` (or, through `as_ptr`, the
// promise its caller makes).
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// `len` zeroed bytes on transparent huge pages where the kernel gives them
    /// (`MADV_HUGEPAGE`; `/sys/kernel/mm/transparent_hugepage/enabled` set to `always` or
    /// `madvise`): fewer page faults on first touch and fewer TLB misses in copies.
    /// Elsewhere the advice does nothing and the pages are ordinary ones. Pages are backed on
    /// first touch, as with any anonymous mapping.
    pub fn zeroed(len: usize) -> Result<HostBuffer, AllocError> {
        Self::map(len, true)
    }

    /// [`HostBuffer::zeroed`], advised for huge pages or not (`huge`; the benchmarks'
    /// comparison of the two).
    pub fn zeroed_with(len: usize, huge: bool) -> Result<HostBuffer, AllocError> {
        Self::map(len, huge)
    }

    fn map(len: usize, huge: bool) -> Result<HostBuffer, AllocError> {
        let fail = |reason: String| AllocError { bytes: len, reason };
        let asked = len;
        let len = len.max(1);
        // Whole pages, and a huge-page-aligned start so the advice covers every whole huge page.
        let align = if huge && len >= HUGE_PAGE { HUGE_PAGE } else { PAGE };
        let map_len = len
            .checked_add(align - 1)
            .and_then(|n| (n / PAGE * PAGE).checked_add(align))
            .ok_or_else(|| fail("more than the address space".into()))?;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing: no
        // existing memory is touched; the result is checked against MAP_FAILED.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0)
        };
        if base == libc::MAP_FAILED {
            return Err(fail(std::io::Error::last_os_error().to_string()));
        }
        let start = (base as usize).next_multiple_of(align);
        let end = (start + len).next_multiple_of(PAGE);
        // SAFETY: [base, start) and [end, base + map_len) are page-aligned parts of the
        // mapping just made, outside the buffer; nothing points into them.
        unsafe {
            if start > base as usize {
                libc::munmap(base, start - base as usize);
            }
            if base as usize + map_len > end {
                libc::munmap(end as *mut libc::c_void, base as usize + map_len - end);
            }
        }
        if align == HUGE_PAGE {
            advise_huge(start, end);
        }
        Ok(HostBuffer { ptr: start as *mut u8, len: asked, mapped: end - start })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start address, for memory that is handed on as raw memory (a KV region). Whoever
    /// writes through it must keep those writes apart from any borrow of [`HostBuffer::bytes`].
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped for this value alone, alive while it is; `as_ptr`'s
        // callers promise not to write while this borrow lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, with the exclusive borrow of `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: [ptr, ptr + mapped) is exactly what `map` kept mapped, owned by this value;
        // its users (a region's connectors) are gone before it is dropped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.mapped) };
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
    fn too_large_to_map_says_so_and_what_to_do() {
        for len in [usize::MAX / 2, usize::MAX - 8] {
            let e = HostBuffer::zeroed(len).unwrap_err();
            assert_eq!(e.bytes, len);
            let e = e.to_string();
            assert!(e.contains("cannot allocate") && e.contains("ask for less"), "{e}");
        }
    }

    #[test]
    fn zeroed_aligned_and_exactly_as_long_as_asked() {
        for (len, huge) in
            [(0usize, true), (1, true), (5000, true), (HUGE_PAGE + 4096 + 3, true), (3 * HUGE_PAGE, false)]
        {
            let mut b = HostBuffer::zeroed_with(len, huge).unwrap();
            assert_eq!((b.len(), b.bytes().len(), b.is_empty()), (len, len, len == 0));
            let align = if huge && len >= HUGE_PAGE { HUGE_PAGE } else { PAGE };
            assert_eq!(b.as_ptr() as usize % align, 0, "len {len}");
            assert!(b.bytes().iter().all(|x| *x == 0));
            b.bytes_mut().fill(7);
            assert!(b.bytes().iter().all(|x| *x == 7));
        }
    }

    #[test]
    fn a_large_buffer_gets_huge_pages_where_the_kernel_gives_them() {
        if !thp_advised() {
            eprintln!("skipped: transparent huge pages are off on this kernel");
            return;
        }
        let mut b = HostBuffer::zeroed(8 * HUGE_PAGE).unwrap();
        b.bytes_mut().fill(1);
        let kib = anon_huge_kib(b.as_ptr() as usize).expect("the buffer's mapping is in /proc/self/smaps");
        // The kernel may fall back to small pages where memory is fragmented, not everywhere.
        assert!(kib >= 2048, "no huge page in an advised 16 MiB buffer ({kib} KiB)");
        let mut plain = HostBuffer::zeroed_with(8 * HUGE_PAGE, false).unwrap();
        plain.bytes_mut().fill(1);
        if std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[madvise]"))
        {
            assert_eq!(anon_huge_kib(plain.as_ptr() as usize), Some(0), "huge pages without the advice");
        }
    }

    #[test]
    fn a_large_vec_advised_gets_huge_pages_and_keeps_its_bytes() {
        // Short slices and a slice with no whole huge page inside are left alone, unharmed.
        let mut small = vec![3u64; 100];
        advise_huge_pages(&mut small);
        advise_huge_pages(&mut small[..0]);
        assert!(small.iter().all(|x| *x == 3));
        if !thp_advised() {
            eprintln!("skipped: transparent huge pages are off on this kernel");
            return;
        }
        let mut v = vec![[0u64; 2]; 8 * HUGE_PAGE / 16];
        advise_huge_pages(&mut v);
        for (i, s) in v.iter_mut().enumerate() {
            *s = [i as u64, !(i as u64)];
        }
        assert!(v.iter().enumerate().all(|(i, s)| *s == [i as u64, !(i as u64)]));
        // The advice splits the mapping: its advised part starts at the first huge boundary.
        let advised = (v.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let kib = anon_huge_kib(advised).expect("the Vec's mapping is in /proc/self/smaps");
        assert!(kib >= 2048, "no huge page in an advised 16 MiB Vec ({kib} KiB)");
    }
}

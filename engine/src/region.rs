//! The memory behind one KV region: zeroed, page-aligned host memory (a
//! [`HostBuffer`], on transparent huge pages where the kernel gives them), or a
//! shared-memory segment. The address never moves while the value lives, because connectors
//! hold it.

#![allow(unsafe_code)] // Regions' memory is reached through raw addresses by the connectors.

use crate::error::EngineError;
use crate::shm::ShmSegment;
use kvconnect_support::host_buffer::HostBuffer;

/// Backing memory of a region.
#[derive(Debug)]
pub enum RegionMemory {
    /// Private host memory.
    Heap(HostBuffer),
    /// A POSIX shared-memory segment.
    Shm(ShmSegment),
}

// SAFETY: the memory is owned by this value and reached only through raw pointers under the
// step protocol (the engine and the connectors never touch the same block at once).
unsafe impl Send for RegionMemory {}
// SAFETY: as above.
unsafe impl Sync for RegionMemory {}

impl RegionMemory {
    /// `len` zeroed bytes of private host memory, on transparent huge pages where the kernel
    /// gives them ([`HostBuffer::zeroed`]).
    pub fn heap(name: &str, len: usize) -> Result<RegionMemory, EngineError> {
        Self::heap_with(name, len, true)
    }

    /// [`RegionMemory::heap`], advised for huge pages or not (`huge`; the benchmark's
    /// baseline).
    pub fn heap_with(name: &str, len: usize, huge: bool) -> Result<RegionMemory, EngineError> {
        HostBuffer::zeroed_with(len, huge)
            .map(RegionMemory::Heap)
            .map_err(|_| EngineError::Alloc { name: name.to_owned(), bytes: len })
    }

    /// `len` zeroed bytes in a new shared-memory segment called `shm_name`.
    pub fn shm(shm_name: &str, len: usize) -> Result<RegionMemory, EngineError> {
        Ok(RegionMemory::Shm(ShmSegment::create_replacing(shm_name, len.max(1))?))
    }

    /// Start address.
    pub fn ptr(&self) -> *mut u8 {
        match self {
            RegionMemory::Heap(b) => b.as_ptr(),
            RegionMemory::Shm(s) => s.ptr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            RegionMemory::Heap(b) => b.len(),
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
            RegionMemory::Heap(_) => None,
            RegionMemory::Shm(s) => Some(s.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_support::host_buffer::HUGE_PAGE;

    #[test]
    fn a_region_too_large_to_map_names_it_and_the_remedy() {
        let e = RegionMemory::heap("layer.0", usize::MAX - 8).unwrap_err().to_string();
        assert!(e.contains("KV region 'layer.0'") && e.contains("lower num_blocks"), "{e}");
    }

    #[test]
    fn heap_regions_are_zeroed_and_huge_page_aligned_when_large() {
        for (len, huge, align) in
            [(5000usize, true, 4096), (3 * HUGE_PAGE, true, HUGE_PAGE), (3 * HUGE_PAGE, false, 4096)]
        {
            let m = RegionMemory::heap_with("t", len, huge).unwrap();
            assert_eq!((m.len(), m.ptr() as usize % align, m.shm_name()), (len, 0, None));
            // SAFETY: the region is `len` bytes of this test's own mapping.
            let bytes = unsafe { std::slice::from_raw_parts_mut(m.ptr(), len) };
            assert!(bytes.iter().all(|b| *b == 0));
            bytes.fill(7);
        }
    }
}

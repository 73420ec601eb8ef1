//! The memory behind one KV region: zeroed, page-aligned host memory, or a shared-memory
//! segment. The address never moves while the value lives, because connectors hold it.

#![allow(unsafe_code)] // Allocates and frees the host memory behind KV regions.

use crate::error::EngineError;
use crate::shm::ShmSegment;
use std::alloc::Layout;

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
    },
    /// A POSIX shared-memory segment.
    Shm(ShmSegment),
}

// SAFETY: the memory is owned by this value and reached only through raw pointers under the
// step protocol (the engine and the connectors never touch the same block at once).
unsafe impl Send for RegionMemory {}
// SAFETY: as above.
unsafe impl Sync for RegionMemory {}

impl RegionMemory {
    /// `len` zeroed bytes of private host memory.
    pub fn heap(name: &str, len: usize) -> Result<RegionMemory, EngineError> {
        let alloc_err = || EngineError::Alloc { name: name.to_owned(), bytes: len };
        let layout = Layout::from_size_align(len.max(1), ALIGN).map_err(|_| alloc_err())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(alloc_err());
        }
        Ok(RegionMemory::Heap { ptr, len })
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
        if let RegionMemory::Heap { ptr, len } = *self {
            if let Ok(layout) = Layout::from_size_align(len.max(1), ALIGN) {
                // SAFETY: `ptr` came from `alloc_zeroed` with this same layout.
                unsafe { std::alloc::dealloc(ptr, layout) };
            }
        }
    }
}

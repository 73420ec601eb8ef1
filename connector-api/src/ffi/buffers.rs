//! Bytes that cross: borrowed for one call ([`AbiBytes`]) or owned by the side that
//! allocated them and freed through the function they carry ([`AbiBuffer`], [`ReceivedBuffer`]).

#![allow(unsafe_code)] // The C ABI itself: raw pointers and function pointers that cross to another library.

/// Borrowed bytes (or UTF-8 text), valid for the duration of one call unless said otherwise.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AbiBytes {
    /// First byte; may be null when `len` is 0.
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl AbiBytes {
    /// Empty bytes.
    pub const EMPTY: AbiBytes = AbiBytes { ptr: core::ptr::null(), len: 0 };

    /// Borrows a static string (the descriptor's names).
    pub const fn from_static(s: &'static str) -> AbiBytes {
        AbiBytes { ptr: s.as_ptr(), len: s.len() }
    }

    /// Borrows bytes for one call.
    #[inline]
    pub fn from_slice(b: &[u8]) -> AbiBytes {
        AbiBytes { ptr: b.as_ptr(), len: b.len() }
    }

    /// The bytes.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that stay valid and unchanged for `'a`
    /// (or `len` must be 0).
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        if self.len == 0 || self.ptr.is_null() {
            &[]
        } else {
            // SAFETY: the caller guarantees ptr/len describe valid bytes for 'a.
            unsafe { core::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    /// The bytes as text; invalid UTF-8 is replaced, since these strings only feed messages
    /// and names.
    ///
    /// # Safety
    /// As for [`AbiBytes::as_slice`].
    pub unsafe fn to_string_lossy(&self) -> String {
        // SAFETY: forwarded to the caller.
        String::from_utf8_lossy(unsafe { self.as_slice() }).into_owned()
    }
}

/// Bytes owned by the side that allocated them, carrying the function that frees them.
#[repr(C)]
#[derive(Debug)]
pub struct AbiBuffer {
    /// First byte (null when empty).
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
    /// Allocated capacity, for the allocator's own use.
    pub cap: usize,
    /// Frees the buffer; called exactly once by whoever received it. Null when empty.
    pub free: Option<unsafe extern "C" fn(ptr: *mut u8, len: usize, cap: usize)>,
}

impl AbiBuffer {
    /// An empty buffer, to pass as an out-parameter.
    #[inline]
    pub const fn empty() -> AbiBuffer {
        AbiBuffer { ptr: core::ptr::null_mut(), len: 0, cap: 0, free: None }
    }

    /// Hands a vector across: the receiver frees it through `free`, which runs this
    /// library's allocator.
    pub fn from_vec(v: Vec<u8>) -> AbiBuffer {
        let mut v = core::mem::ManuallyDrop::new(v);
        AbiBuffer { ptr: v.as_mut_ptr(), len: v.len(), cap: v.capacity(), free: Some(free_vec) }
    }
}

unsafe extern "C" fn free_vec(ptr: *mut u8, len: usize, cap: usize) {
    if !ptr.is_null() {
        // SAFETY: (ptr, len, cap) came from `AbiBuffer::from_vec` in this same library, and the
        // receiver calls `free` once.
        drop(unsafe { Vec::from_raw_parts(ptr, len, cap) });
    }
}

/// A buffer received from the other side: read it, and it is freed on drop through its own
/// free function.
#[derive(Debug)]
pub struct ReceivedBuffer(AbiBuffer);

impl ReceivedBuffer {
    /// Takes ownership of a buffer the other side filled in.
    ///
    /// # Safety
    /// `buf` must be empty or have been filled by the other side of this ABI and not freed.
    #[inline]
    pub unsafe fn new(buf: AbiBuffer) -> ReceivedBuffer {
        ReceivedBuffer(buf)
    }

    /// The bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        if self.0.ptr.is_null() || self.0.len == 0 {
            &[]
        } else {
            // SAFETY: `new`'s contract: the other side allocated `len` bytes, which live until
            // we call `free` in `drop`.
            unsafe { core::slice::from_raw_parts(self.0.ptr, self.0.len) }
        }
    }
}

impl Drop for ReceivedBuffer {
    #[inline]
    fn drop(&mut self) {
        if let Some(free) = self.0.free {
            // SAFETY: the buffer came from the other side (see `new`) and is freed exactly once,
            // by the function it carries, in the library that allocated it.
            unsafe { free(self.0.ptr, self.0.len, self.0.cap) };
        }
    }
}

// SAFETY: the buffer exclusively owns its bytes; the free function is thread-agnostic
// (it runs the allocating library's global allocator).
unsafe impl Send for ReceivedBuffer {}

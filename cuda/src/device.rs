//! A GPU context, device buffers that can be exported over CUDA IPC, and pinned host
//! buffers.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use crate::error::CudaError;
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::sync::Arc;

/// One GPU: a context and a non-default stream (IPC copies and the default stream do not
/// mix well), found and checked before the first driver call.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
}

/// Checks that the driver and NVRTC libraries can be loaded. cudarc's dynamic loading
/// panics on a missing library, so this runs before anything else touches it.
pub fn check_libraries() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library by its candidate names; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver("none of the candidate names of libcuda could be opened".into()));
    }
    // SAFETY: as above, for NVRTC.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc("none of the candidate names of libnvrtc could be opened".into()));
    }
    Ok(())
}

impl Gpu {
    /// Opens GPU `ordinal`.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        check_libraries()?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::NoDevice { ordinal, message: format!("{e}") })?;
        let stream = ctx.new_stream().map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        Ok(Gpu { ctx, stream, ordinal })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all of this crate's work goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Device name, e.g. "NVIDIA H200".
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    /// `sm_XY` for NVRTC.
    pub fn arch(&self) -> Result<String, CudaError> {
        let (major, minor) =
            self.ctx.compute_capability().map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))?;
        Ok(format!("sm_{major}{minor}"))
    }

    /// The PCI bus id ("0000:1a:00.0"), which names a GPU the same way in every process
    /// whatever CUDA_VISIBLE_DEVICES renumbers.
    pub fn pci_bus_id(&self) -> Result<String, CudaError> {
        pci_bus_id_of(self.ctx.cu_device())
    }

    /// Opens the GPU with this PCI bus id, as this process numbers it; `Ok(None)` when no
    /// visible GPU has it (CUDA_VISIBLE_DEVICES hides it).
    pub fn open_by_pci_bus_id(bus_id: &str) -> Result<Option<Gpu>, CudaError> {
        check_libraries()?;
        let count = CudaContext::device_count().map_err(|e| CudaError::driver("cuDeviceGetCount", e))?;
        for ordinal in 0..count.max(0) as usize {
            let mut dev: sys::CUdevice = 0;
            // SAFETY: `dev` is a plain out-parameter; the driver was initialised by
            // device_count.
            let r = unsafe { sys::cuDeviceGet(&mut dev, ordinal as std::ffi::c_int) };
            if r != sys::cudaError_enum::CUDA_SUCCESS {
                continue;
            }
            if pci_bus_id_of(dev)?.eq_ignore_ascii_case(bus_id) {
                return Gpu::open(ordinal).map(Some);
            }
        }
        Ok(None)
    }

    /// Whether kernels on this GPU can read `peer`'s memory directly (NVLink or PCIe peer
    /// access), as `cuDeviceCanAccessPeer` says. A GPU can always access itself.
    pub fn can_access_peer(&self, peer: &Gpu) -> Result<bool, CudaError> {
        let (own, other) = (self.ctx.cu_device(), peer.ctx.cu_device());
        if own == other {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: both devices come from live contexts; `can` is a plain out-parameter.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, own, other) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::driver("cuDeviceCanAccessPeer", cudarc::driver::DriverError(r)));
        }
        Ok(can != 0)
    }

    /// Enables this context's access to `peer`'s memory; false when the devices cannot.
    pub fn enable_peer_access(&self, peer: &Gpu) -> Result<bool, CudaError> {
        if !self.can_access_peer(peer)? {
            return Ok(false);
        }
        if self.ctx.cu_device() == peer.ctx.cu_device() {
            return Ok(true);
        }
        self.bind()?;
        // SAFETY: this context is current; the peer context is live.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        Ok(r == sys::cudaError_enum::CUDA_SUCCESS
            || r == sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    }

    /// An event a waiting host thread sleeps on (blocking sync) instead of spinning.
    pub fn completion_event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        self.ctx.new_event(flags).map_err(|e| CudaError::driver("cuEventCreate", e))
    }

    /// A fresh event (no timing) in this context.
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        self.ctx.new_event(flags).map_err(|e| CudaError::driver("cuEventCreate", e))
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(|e| CudaError::driver("cuCtxSetCurrent", e))
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(|e| CudaError::driver("cuStreamSynchronize", e))
    }

    /// Allocates `bytes` of device memory with plain `cuMemAlloc` (IPC-exportable).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        self.bind()?;
        // SAFETY: the context is current; the pointer is owned by the returned buffer and
        // freed exactly once in its Drop.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                CudaError::OutOfMemory { bytes, ordinal: self.ordinal }
            } else {
                CudaError::driver("cuMemAlloc", e)
            }
        })?;
        Ok(DeviceBuffer { ptr, bytes, ctx: self.ctx.clone() })
    }

    /// Allocates pinned host memory the GPU can address directly (mapped, portable).
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer, CudaError> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is current; the pointer is owned by the returned buffer and
        // freed exactly once in its Drop.
        let host = unsafe { result::malloc_host(bytes, flags) }
            .map_err(|e| CudaError::driver("cuMemHostAlloc", e))?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated with DEVICEMAP, so it has a device address.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            // SAFETY: freeing what we just allocated, once.
            unsafe {
                let _ = result::free_host(host);
            }
            return Err(CudaError::driver("cuMemHostGetDevicePointer", cudarc::driver::DriverError(r)));
        }
        Ok(PinnedBuffer { host: host as *mut u8, dev, bytes, ctx: self.ctx.clone() })
    }

    /// Copies host bytes into device memory at `dst` (synchronously).
    pub fn upload(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller passes a device address with at least src.len() bytes; the
        // stream is synchronised before `src` can go away.
        unsafe {
            result::memcpy_htod_async(dst, src, self.stream.cu_stream())
                .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))?;
        }
        self.synchronize()
    }

    /// Copies device bytes at `src` into `dst` (synchronously).
    pub fn download(&self, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: as in `upload`, in the other direction.
        unsafe {
            result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
                .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))?;
        }
        self.synchronize()
    }

    /// Enqueues a device-to-device copy on the stream.
    pub fn copy_dtod_async(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: the caller passes device addresses valid for `bytes`.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("cuMemcpyDtoDAsync", e))
    }

    /// Fills device memory with a byte (asynchronously).
    pub fn memset_async(&self, dst: u64, value: u8, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: the caller passes a device address valid for `bytes`.
        unsafe { result::memset_d8_async(dst, value, bytes, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("cuMemsetD8Async", e))
    }

    /// Runs `f` between two timing events on the stream and returns the milliseconds.
    pub fn time<F: FnOnce() -> Result<(), CudaError>>(&self, f: F) -> Result<f64, CudaError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(|e| CudaError::driver("cuEventCreate", e))?;
        let end = self.ctx.new_event(flags).map_err(|e| CudaError::driver("cuEventCreate", e))?;
        start.record(&self.stream).map_err(|e| CudaError::driver("cuEventRecord", e))?;
        f()?;
        end.record(&self.stream).map_err(|e| CudaError::driver("cuEventRecord", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| CudaError::driver("cuEventElapsedTime", e))?;
        Ok(ms as f64)
    }
}

fn pci_bus_id_of(dev: sys::CUdevice) -> Result<String, CudaError> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer is 32 bytes, as the length passed says; the driver NUL-terminates.
    let r = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as std::ffi::c_int, dev) };
    if r != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(CudaError::driver("cuDeviceGetPCIBusId", cudarc::driver::DriverError(r)));
    }
    Ok(buf.iter().take_while(|c| **c != 0).map(|c| *c as u8 as char).collect())
}

/// Device memory from `cuMemAlloc`, freed on drop.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed only here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory mapped into the GPU's address space, freed on drop.
pub struct PinnedBuffer {
    host: *mut u8,
    dev: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain memory owned by this value; access goes through &self/&mut self.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// The device address of the mapping (for kernels).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// The device address of the mapping in `gpu`'s context (the buffer is portable, so
    /// every context can address it; with unified addressing it is the same number).
    pub fn device_ptr_in(&self, gpu: &Gpu) -> Result<u64, CudaError> {
        gpu.bind()?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` is a live portable, mapped allocation; `dev` is an out-parameter.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, self.host as *mut std::ffi::c_void, 0) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::driver("cuMemHostGetDevicePointer", cudarc::driver::DriverError(r)));
        }
        Ok(dev)
    }

    /// The host address (for asynchronous copies by the copy engines).
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The bytes, on the host. Call only after the stream that wrote them is synchronised.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `host` points to `bytes` bytes owned by this value.
        unsafe { std::slice::from_raw_parts(self.host, self.bytes) }
    }

    /// Mutable host view.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.bytes) }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `host` came from cuMemHostAlloc and is freed only here.
            let _ = unsafe { result::free_host(self.host as *mut std::ffi::c_void) };
        }
    }
}

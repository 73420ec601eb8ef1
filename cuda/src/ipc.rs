//! CUDA IPC: exporting a device region to another process on the same host, and opening a
//! peer's region once.

#![allow(unsafe_code)] // CUDA bindings: driver calls and device memory.

use crate::device::{DeviceBuffer, Gpu};
use crate::error::CudaError;
use cudarc::driver::sys;
use serde::{Deserialize, Serialize};

/// A 64-byte `CUipcMemHandle`, as hex for JSON handshakes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcHandle {
    /// The handle's bytes, hex.
    pub hex: String,
    /// Size of the exported region in bytes.
    pub bytes: usize,
}

impl IpcHandle {
    /// Exports a buffer allocated with `Gpu::alloc`.
    pub fn export(gpu: &Gpu, buf: &DeviceBuffer) -> Result<IpcHandle, CudaError> {
        gpu.bind()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `buf` is a live cuMemAlloc allocation in the current context.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, buf.ptr()) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::driver("cuIpcGetMemHandle", cudarc::driver::DriverError(r)));
        }
        let hex = h.reserved.iter().map(|b| format!("{:02x}", *b as u8)).collect();
        Ok(IpcHandle { hex, bytes: buf.len() })
    }

    /// Exports the allocation that starts at device address `ptr` (from `cuMemAlloc`, e.g.
    /// a region the host allocated with [`Gpu::alloc`] and registered by address, or a
    /// framework's tensor that is its own allocation). The driver checks the address; one
    /// that is not such an allocation is an error, not a crash. A handle names a whole
    /// allocation and its importer maps it from its start, so a region that starts inside
    /// an allocation (a tensor carved from a caching allocator's segment) is refused rather
    /// than read at the wrong place.
    pub fn export_address(gpu: &Gpu, ptr: u64, bytes: usize) -> Result<IpcHandle, CudaError> {
        gpu.bind()?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: the driver validates `ptr` and only writes the two outputs.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::driver("cuMemGetAddressRange", cudarc::driver::DriverError(r)));
        }
        if base != ptr || size < bytes {
            return Err(CudaError::IpcExport(format!(
                "not implemented: the region at {ptr:#x} ({bytes} bytes) lies {} bytes into a CUDA \
                    allocation of {size} bytes, and an IPC handle maps whole allocations from their start; \
                    allocate each KV cache tensor as its own allocation (vLLM does; in PyTorch a tensor of \
                    10 MiB or more allocated before others are freed is one)",
                ptr.saturating_sub(base)
            )));
        }
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: the driver validates `ptr` and fails for anything not a live allocation.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::driver("cuIpcGetMemHandle", cudarc::driver::DriverError(r)));
        }
        let hex = h.reserved.iter().map(|b| format!("{:02x}", *b as u8)).collect();
        Ok(IpcHandle { hex, bytes })
    }

    fn raw(&self) -> Result<sys::CUipcMemHandle, CudaError> {
        let bad = || CudaError::IpcOpen(format!("malformed handle '{}' (want 128 hex digits)", self.hex));
        if self.hex.len() != 128 {
            return Err(bad());
        }
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        for (i, slot) in h.reserved.iter_mut().enumerate() {
            let byte =
                u8::from_str_radix(self.hex.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
            *slot = byte as std::ffi::c_char;
        }
        Ok(h)
    }
}

/// A peer's region mapped into this process; unmapped on drop.
pub struct ImportedRegion {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl ImportedRegion {
    /// Opens a peer's handle with lazy peer access (works across GPUs of one host too).
    pub fn open(gpu: &Gpu, handle: &IpcHandle) -> Result<ImportedRegion, CudaError> {
        let raw = handle.raw()?;
        gpu.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `raw` is a handle's bytes; the driver validates it and fails cleanly for
        // a handle whose owner is gone.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::IpcOpen(format!("{:?}", r)));
        }
        let region = ImportedRegion { ptr, bytes: handle.bytes, ctx: gpu.context().clone() };
        // The size comes with the handle, from the peer: the mapping must hold that many
        // bytes, or reads past its end would land in whatever this process maps next to it.
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: `ptr` is the live mapping just opened; the driver only writes the two outputs.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::IpcOpen(format!("cuMemGetAddressRange of the mapping: {r:?}")));
        }
        if base != ptr || size < handle.bytes {
            return Err(CudaError::IpcOpen(format!(
                "the handle maps {size} bytes but its owner claims {}: refused",
                handle.bytes
            )));
        }
        Ok(region)
    }

    /// Device address in this process.
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

impl Drop for ImportedRegion {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed only here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

//! Errors from the GPU path, each saying what failed and what to do.

/// What went wrong talking to the GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library on this machine.
    #[error(
        "no CUDA driver found (libcuda.so.1 could not be loaded: {0}); kv_buffer_device=\"cuda\" needs \
        an NVIDIA GPU with its driver — use kv_buffer_device=\"cpu\" on this machine"
    )]
    NoDriver(String),
    /// No NVRTC library.
    #[error(
        "NVRTC (libnvrtc) could not be loaded: {0}; install the CUDA runtime compiler library matching \
        the driver, or use kv_buffer_device=\"cpu\""
    )]
    NoNvrtc(String),
    /// The driver is there but has no such device.
    #[error("GPU {ordinal} is not available: {message}")]
    NoDevice {
        /// Device ordinal asked for.
        ordinal: usize,
        /// The driver's message.
        message: String,
    },
    /// A driver call failed.
    #[error("CUDA call {call} failed: {message}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error name and text.
        message: String,
    },
    /// Out of device memory.
    #[error(
        "out of GPU memory allocating {bytes} bytes on GPU {ordinal}: lower the KV cache size \
        (num_blocks) or free memory on the device"
    )]
    OutOfMemory {
        /// Bytes asked for.
        bytes: usize,
        /// Device.
        ordinal: usize,
    },
    /// The kernel did not compile.
    #[error("compiling the gather kernel for {arch} failed: {log}")]
    Compile {
        /// Target architecture.
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// A peer's IPC handle could not be opened (peer gone, or not the same host).
    #[error(
        "opening the peer's CUDA IPC handle failed: {0}; the peer process may have exited or is on \
        another host — the request fails or recomputes as kv_load_failure_policy says"
    )]
    IpcOpen(String),
    /// A region that cannot be exported as an IPC handle of its own.
    #[error("exporting a KV region over CUDA IPC: {0}")]
    IpcExport(String),
    /// Arguments that do not fit.
    #[error("invalid gather: {0}")]
    Invalid(String),
}

impl CudaError {
    /// A failed driver call, named; out of memory is worded as such.
    pub fn driver(call: &'static str, e: cudarc::driver::DriverError) -> CudaError {
        if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            return CudaError::Driver { call, message: "CUDA_ERROR_OUT_OF_MEMORY".into() };
        }
        CudaError::Driver { call, message: format!("{e}") }
    }
}

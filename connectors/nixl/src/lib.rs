//! Pull-mode P/D KV transport: the real NIXL library, plus built-in shm and tcp backends.

pub mod caps;

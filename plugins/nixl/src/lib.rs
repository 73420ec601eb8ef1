//! The `nixl` connector exported as a kvconnect plugin: `kvconnect_nixl::NixlFactory` behind
//! the C ABI, through the SDK's `export_connector!`. The host links the same connector as a
//! built-in; this library lets a host built without it (or a C/C++ host) load it.

kvconnect_api::export_connector!("nixl", kvconnect_nixl::NixlFactory);

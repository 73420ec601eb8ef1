//! The `lmcache` connector exported as a kvconnect plugin: `kvconnect_lmcache::LmcacheFactory`
//! behind the C ABI, through the SDK's `export_connector!`.
//!
//! The library carries its own copy of the connector, so its stores (and their statistics)
//! are separate from an in-process `kvconnect_lmcache`'s; the two share a cache through the
//! same `local_disk` directory, whose keys and files are the same in every process.

kvconnect_api::export_connector!("lmcache", kvconnect_lmcache::LmcacheFactory);

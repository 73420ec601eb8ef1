//! The `flexkv` connector exported as a kvconnect plugin: `kvconnect_flexkv::FlexkvFactory`
//! behind the C ABI, through the SDK's `export_connector!`. The library carries its own copy
//! of the connector and its caches.

kvconnect_api::export_connector!("flexkv", kvconnect_flexkv::FlexkvFactory::new());

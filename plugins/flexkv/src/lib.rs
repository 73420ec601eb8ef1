//! The `flexkv` connector exported as a kvconnect plugin.

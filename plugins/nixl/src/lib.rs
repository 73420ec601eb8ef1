//! The `nixl` connector exported as a kvconnect plugin.

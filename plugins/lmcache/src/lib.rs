//! The `lmcache` connector exported as a kvconnect plugin.

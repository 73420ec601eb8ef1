//! Shared helpers for kvconnect's end-to-end tests.

//! The composite connector: several children, one negotiated layout.

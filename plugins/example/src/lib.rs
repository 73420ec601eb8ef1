//! A third-party plugin template.

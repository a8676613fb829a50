//! The soak test (work in progress).

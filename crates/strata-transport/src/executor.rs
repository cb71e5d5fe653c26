//! The worker executor service (being written).

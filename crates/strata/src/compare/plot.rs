//! The plots (being written).

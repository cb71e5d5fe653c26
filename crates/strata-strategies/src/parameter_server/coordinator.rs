//! The cluster coordinator (being written).

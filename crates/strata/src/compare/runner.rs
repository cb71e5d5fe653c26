//! Real runs (being written).

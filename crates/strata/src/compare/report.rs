//! The report (being written).

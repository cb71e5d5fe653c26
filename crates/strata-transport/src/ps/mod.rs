//! The parameter server: servers and clients (being written).

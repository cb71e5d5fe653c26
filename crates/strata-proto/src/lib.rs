//! Strata's gRPC protocol.

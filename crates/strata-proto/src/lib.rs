//! Strata's gRPC protocol, generated at build time from `proto/strata/v1/*.proto` with protox
//! and tonic-prost-build (no `protoc` is needed). This crate holds generated code only; the
//! servers and clients live in `strata-transport`.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// Version 1 of the protocol (`package strata.v1`).
pub mod v1 {
    tonic::include_proto!("strata.v1");
}

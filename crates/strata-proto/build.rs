//! Compiles `proto/strata/v1/*.proto` with protox (pure Rust: no `protoc` needed) and generates
//! the tonic services with tonic-prost-build.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let dir = root.join("strata/v1");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    files.sort();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    println!("cargo:rerun-if-changed={}", dir.display());
    let fds = protox::compile(&files, [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Tensor payloads are shared, not copied, between the stream and the caller.
        .bytes(".strata.v1.BenchChunk.data")
        .bytes(".strata.v1.TensorChunk.data")
        .bytes(".strata.v1.RunStepRequest.args")
        .bytes(".strata.v1.RunStepResponse.result")
        .compile_fds(fds)?;
    Ok(())
}

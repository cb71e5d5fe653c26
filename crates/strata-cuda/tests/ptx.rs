//! Every kernel source compiles with NVRTC to PTX (compute_80 and compute_90) and `ptxas`
//! assembles that PTX for sm_80 and sm_90: the GPU-free proof that the kernels build for A100s and
//! H100s. Needs the `cuda` feature, libnvrtc on the library path and `ptxas` on `PATH`; without
//! them it is skipped with a message, unless `STRATA_REQUIRE_NVRTC=1`, when it fails (CI sets it).
//!
//! Run with `--nocapture` to see one line per kernel source.

/// Set to `1` to turn a skip (no NVRTC, no ptxas, no `cuda` feature) into a failure.
const REQUIRE: &str = "STRATA_REQUIRE_NVRTC";

fn skip(why: &str) {
    if std::env::var(REQUIRE).is_ok_and(|v| v == "1") {
        panic!("{REQUIRE}=1 but the PTX test cannot run: {why}");
    }
    eprintln!("skipped: {why} (set {REQUIRE}=1 to make this a failure)");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn every_kernel_compiles_to_ptx_and_assembles_for_sm80_and_sm90() {
    skip("strata-cuda was built without the `cuda` feature (NVRTC is reached through cudarc)");
}

/// `ptxas` on `PATH`, if any.
#[cfg(feature = "cuda")]
fn ptxas() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("ptxas")).find(|p| p.is_file())
}

#[cfg(feature = "cuda")]
#[test]
fn every_kernel_compiles_to_ptx_and_assembles_for_sm80_and_sm90() {
    use std::path::PathBuf;
    use std::process::Command;
    use strata_cuda::kernels::{nvrtc, SOURCES};

    if let Err(e) = strata_cuda::probe::nvrtc() {
        return skip(&e.to_string());
    }
    let Some(ptxas) = ptxas() else {
        return skip("ptxas is not on PATH (pip install nvidia-cuda-nvcc and add its bin directory to PATH)");
    };
    let version = Command::new(&ptxas).arg("--version").output().expect("ptxas runs");
    let version = String::from_utf8_lossy(&version.stdout);
    println!("ptxas: {}", version.lines().last().unwrap_or("").trim());

    let dir = std::env::temp_dir().join(format!("strata-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let assemble = |ptx_file: &PathBuf, sm: &str| -> usize {
        let cubin = ptx_file.with_extension(format!("{sm}.cubin"));
        let out = Command::new(&ptxas)
            .args([&format!("-arch={sm}"), ptx_file.to_str().unwrap(), "-o", cubin.to_str().unwrap()])
            .output()
            .expect("ptxas runs");
        assert!(
            out.status.success(),
            "ptxas -arch={sm} {} failed: {}{}",
            ptx_file.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::metadata(&cubin).unwrap().len() as usize
    };

    for source in SOURCES {
        let mut line = format!("{}:", source.name);
        for (arch, sms) in [("compute_80", &["sm_80", "sm_90"][..]), ("compute_90", &["sm_90"][..])] {
            let ptx = match nvrtc::compile(source, arch) {
                Ok(ptx) => ptx,
                Err(e) => panic!("{e}"),
            };
            for f in source.functions {
                assert!(ptx.contains(&format!(".entry {f}(")), "{} for {arch}: no entry {f}", source.name);
            }
            // --fmad=false and the _rn intrinsics: no fused multiply-add in the PTX
            assert!(!ptx.contains("fma.rn.f32"), "{} for {arch}: the PTX contains an FMA", source.name);
            let file = dir.join(format!("{}.{arch}.ptx", source.name.trim_end_matches(".cu")));
            std::fs::write(&file, &ptx).unwrap();
            let mut parts = Vec::new();
            for sm in sms {
                let bytes = assemble(&file, sm);
                parts.push(format!("{sm} ok ({bytes} bytes cubin)"));
            }
            line.push_str(&format!(" {arch} ptx {} bytes, {};", ptx.len(), parts.join(", ")));
        }
        println!("{}", line.trim_end_matches(';'));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cached entry point returns the same PTX for the same architecture.
#[cfg(feature = "cuda")]
#[test]
fn ptx_is_cached_per_architecture() {
    use strata_cuda::kernels::{nvrtc, AXPY};
    if let Err(e) = strata_cuda::probe::nvrtc() {
        return skip(&e.to_string());
    }
    let a = nvrtc::ptx(&AXPY, "compute_80").unwrap();
    let b = nvrtc::ptx(&AXPY, "compute_80").unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    let c = nvrtc::ptx(&AXPY, "compute_90").unwrap();
    assert!(c.contains(".target sm_90"), "compute_90 PTX targets sm_90");
    assert!(a.contains(".target sm_80"));
}

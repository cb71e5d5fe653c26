//! Gating for GPU tests: [`require_gpus`] skips a test with a message where there are too few
//! GPUs, and fails it instead when `STRATA_REQUIRE_GPU=1`, so a GPU run never silently tests
//! nothing.

/// The environment variable that turns a skipped GPU test into a failure.
pub const STRATA_REQUIRE_GPU: &str = "STRATA_REQUIRE_GPU";

/// The number of usable GPUs (driver present, CUDA initialised, visibility applied), or why
/// there are none.
pub fn gpu_count() -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        crate::probe::driver().map_err(|e| e.to_string())?;
        match cudarc::driver::result::init() {
            Ok(()) => {}
            Err(e) => return Err(format!("the CUDA driver did not initialise: {e:?}")),
        }
        cudarc::driver::result::device::get_count()
            .map(|n| n.max(0) as usize)
            .map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("strata-cuda was built without the `cuda` feature".to_string())
    }
}

/// `true` when at least `n` GPUs are usable. Otherwise prints why the calling test is skipped
/// and returns `false`, or panics when `STRATA_REQUIRE_GPU=1`.
///
/// ```
/// if !strata_cuda::testing::require_gpus(1) {
///     return; // skipped: no GPU here
/// }
/// ```
pub fn require_gpus(n: usize) -> bool {
    let required = std::env::var(STRATA_REQUIRE_GPU).is_ok_and(|v| v == "1");
    let why = match gpu_count() {
        Ok(have) if have >= n => return true,
        Ok(have) => format!("needs {n} GPU(s), {have} usable"),
        Err(e) => format!("needs {n} GPU(s): {e}"),
    };
    if required {
        panic!("{STRATA_REQUIRE_GPU}=1 but this test cannot run: {why}");
    }
    eprintln!("skipped: {why} (set {STRATA_REQUIRE_GPU}=1 to make this a failure)");
    false
}

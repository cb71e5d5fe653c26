//! What every benchmark prints the same way: medians and the CPU's name (a leaf: it imports no
//! benchmark).

/// The median of `v`: the middle value, or the mean of the two middle ones; 0 for none.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// This machine's CPU as `/proc/cpuinfo` names it (its first `model name`), where it says.
pub(crate) fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
}

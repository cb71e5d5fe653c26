//! The simulator's time model against the committed slow-links records
//! (`docs/bench/slow-links-{4,2}hosts-2026-12-04.json`): per-step sync and DiLoCo (int8 and
//! streaming fragments too) at 50 Mbit/s and 1 Gbit/s within 15% of the measured tokens/s.

use std::path::PathBuf;

use strata_compare::calibrate::{calibrate, load, Role};

fn record(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/bench").join(name)
}

#[test]
fn the_time_model_predicts_the_emulated_host_runs_within_15_percent() {
    let records = ["slow-links-4hosts-2026-12-04.json", "slow-links-2hosts-2026-12-04.json"]
        .map(|f| load(&record(f)).unwrap_or_else(|e| panic!("{e}")));
    let cal = calibrate(&records).unwrap();
    println!("compute {:.2} ms a step, overlap {:.3}\n{}", cal.compute_s * 1e3, cal.overlap, cal.table());
    assert_eq!(cal.parameters, 816_705);
    assert_eq!(cal.tokens_per_step, 2048.0);
    // Every Strata row of both records, torch's left out.
    assert_eq!(cal.rows.len(), 10, "{}", cal.table());
    let at = |hosts: usize, link: &str, config: &str| {
        cal.rows
            .iter()
            .find(|r| r.hosts == hosts && r.link == link && r.config == config)
            .unwrap_or_else(|| panic!("no row {hosts} {link} {config}"))
    };
    for (hosts, link, config) in [
        (4, "50mbit", "sync"),
        (4, "50mbit", "diloco:100"),
        (4, "50mbit", "diloco:100:int8"),
        (4, "50mbit", "streaming:100:4"),
        (2, "1gbit", "diloco:100"),
        (4, "unshaped", "diloco:100:int8"),
        (4, "unshaped", "streaming:100:4"),
    ] {
        let r = at(hosts, link, config);
        assert_eq!(r.role, Role::Predicted, "{r:?}");
        assert!(r.error.abs() <= 0.15, "{hosts} hosts {link} {config}: {:+.1}%\n{}", r.error * 100.0, cal.table());
    }
    assert_eq!(at(4, "unshaped", "diloco:100").role, Role::ComputeSource);
    assert_eq!(at(2, "1gbit", "sync").role, Role::OverlapSource);
    assert!(at(2, "1gbit", "sync").error.abs() < 1e-3, "the overlap is fitted to it");
    assert_eq!(at(4, "unshaped", "sync").role, Role::OutsideModel);
    // The model's figures are physical: ~38 ms of compute a step, some of it hiding the ring.
    assert!((0.030..0.045).contains(&cal.compute_s), "{}", cal.compute_s);
    assert!((0.0..0.9).contains(&cal.overlap), "{}", cal.overlap);
    // The link, not the compute, decides per-step sync at 50 Mbit/s: 18x slower than DiLoCo.
    let ratio = at(4, "50mbit", "diloco:100").predicted / at(4, "50mbit", "sync").predicted;
    assert!((12.0..25.0).contains(&ratio), "{ratio}");
}

#[test]
fn a_record_without_a_compute_source_is_refused_in_one_line() {
    let mut r = load(&record("slow-links-2hosts-2026-12-04.json")).unwrap();
    let e = calibrate(std::slice::from_ref(&r)).unwrap_err().to_string();
    assert!(e.contains("no unshaped diloco run") && !e.contains('\n') && !e.ends_with('.'), "{e}");
    r.header.clear();
    let bad = load(&record("README.md")).unwrap_err().to_string();
    assert!(bad.contains("is not a slow-links record"), "{bad}");
}

//! `strata bench train` runs every configuration and prints the table with the same run's
//! compute limit and ceiling beside each figure; `strata bench kernels` times each kernel beside
//! the same run's peaks and names the code that ran. They check the shape of the report, never
//! a timing.

use std::process::Command;

#[test]
fn bench_train_prints_every_configuration_beside_the_limit_and_the_ceiling() {
    let o = Command::new(strata_integration_tests::strata_bin())
        .args(["bench", "train", "--models", "small", "--rounds", "1", "--seconds", "0.2", "--zero-stages", "0,1"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    let header = out.lines().find(|l| l.starts_with("model")).expect("a header row");
    for column in ["examples/s", "of ceiling", "of limit", "reduced/step", "params/rep", "grads/rep", "optim/rep"] {
        assert!(header.contains(column), "{column} missing from {header}");
    }
    assert!(!out.contains("TF") && !out.contains("DDP"), "no ratio to a figure measured elsewhere: {out}");
    let limit = out.lines().find(|l| l.starts_with("# small:")).expect("the limit's line");
    assert!(limit.contains("0.507 MFLOP per example") && limit.contains("GFLOP/s"), "{limit}");
    let rows: Vec<Vec<&str>> =
        out.lines().filter(|l| l.starts_with("small ")).map(|l| l.split_whitespace().collect()).collect();
    let configs: Vec<&str> = rows.iter().map(|r| r[2]).collect();
    assert_eq!(
        configs,
        [
            "limit",
            "limit/1",
            "ceiling",
            "one-device",
            "mirrored",
            "multi-worker",
            "mirrored+zero1",
            "multi-worker+zero1"
        ]
    );
    for r in &rows {
        let eps: f64 = r[4].parse().unwrap();
        assert!(eps > 0.0, "{r:?}");
    }
    // Mirrored hands the all-reduce every trainable parameter, 4 bytes each, per step; a
    // replica keeps 85,002 parameters and gradients (0.32 MiB each) and AdamW's two moments of
    // its half (0.32 MiB): on one machine's CPU, stage 0 steps shards as stage 1 does
    // (`StrategyOptions::host_shards`). The last column is what a replica held at once in a
    // step, counted by the strategy: the model state and the activations besides.
    let tail = |config: &str| {
        let r = rows.iter().find(|r| r[2] == config).unwrap();
        r[r.len() - 6..].to_vec()
    };
    assert_eq!(tail("mirrored")[..5], ["340008", "B", "0.32M", "0.32M", "0.32M"]);
    assert_eq!(tail("mirrored+zero1")[..5], ["340008", "B", "0.32M", "0.32M", "0.32M"]);
    assert_eq!(tail("multi-worker+zero1")[2..5], ["0.32M", "0.32M", "0.32M"]);
    let held = |config: &str| tail(config)[5].trim_end_matches('M').parse::<f64>().unwrap();
    for (config, model_state) in [("mirrored", 0.96), ("mirrored+zero1", 0.96), ("multi-worker+zero1", 0.96)] {
        assert!(held(config) > model_state, "{config}: {:?}", tail(config));
    }
}

#[test]
fn bench_kernels_names_the_code_that_ran_and_each_kernels_share_of_the_peak() {
    let o = Command::new(strata_integration_tests::strata_bin())
        .args(["bench", "kernels", "--seconds", "0.01", "--reps", "1"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    let level = out.lines().find_map(|l| l.split("vector code: ").nth(1)).expect("the vector code's line");
    let peak = out.lines().find_map(|l| l.strip_prefix("# compute peak: ")).expect("the compute peak's line");
    assert!(peak.split_whitespace().next().unwrap().parse::<f64>().unwrap() > 0.0, "{peak}");
    let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#') && !l.starts_with("kernel")).collect();
    for kernel in [
        "matmul forward",
        "matmul grad input",
        "matmul grad weight",
        "batched matmul",
        "bias + GELU fwd+bwd",
        "causal softmax fwd+bwd",
        "layer norm fwd+bwd",
        "column sum",
        "log-softmax",
        "AdamW step",
    ] {
        assert!(rows.iter().any(|r| r.starts_with(kernel)), "{kernel} missing: {out}");
    }
    // Each row's code is the level the header names, and its share of the peak a percentage.
    let (gemm, fused) = if level.starts_with("x86-v4") {
        ("gemm avx512f", "pulp V4")
    } else if level.starts_with("x86-v3") {
        ("gemm fma (AVX2)", "pulp V3")
    } else {
        ("gemm scalar", "scalar")
    };
    for r in &rows {
        // As an AVX2 host, candle's rows_gemm takes the products of two row-major operands with
        // k and n from 512: of these rows, the 4.3M MLP's hidden forward product alone.
        let rows_gemm =
            level.starts_with("x86-v3") && r.starts_with("matmul forward") && r.contains("large MLP hidden");
        if rows_gemm {
            assert!(r.contains("rows_gemm AVX2"), "{r} under {level}");
        } else if r.contains("matmul") {
            assert!(r.contains(gemm), "{r} under {level}");
        }
        if r.contains("GELU") || r.contains("softmax fwd") || r.contains("layer norm") {
            assert!(r.contains(fused), "{r} under {level}");
        }
        let share: f64 = r.split_whitespace().last().unwrap().trim_end_matches('%').parse().unwrap();
        assert!(share > 0.0, "{r}");
    }
}

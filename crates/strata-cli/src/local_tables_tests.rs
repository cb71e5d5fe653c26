//! The tests of `--table-optimizer` under the in-process strategies (`local_tables`), through
//! `strata train`'s own entry point (a module of their own: `train` uses `local_tables`).

use clap::Parser;

use crate::train_args::TrainArgs;

/// `strata train`'s flags alone.
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    args: TrainArgs,
}

fn train_args(flags: &[&str]) -> TrainArgs {
    let argv = ["train", "--no-progress"].iter().chain(flags).copied();
    Flags::try_parse_from(argv).unwrap().args
}

fn refused(flags: &[&str]) -> String {
    crate::train::run(&train_args(flags)).unwrap_err().to_string()
}

#[test]
fn table_flags_are_refused_where_they_do_not_apply_in_one_line() {
    let e = refused(&["--model", "mlp", "--table-optimizer", "sgd"]);
    assert_eq!(e, "--table-optimizer applies to --model ctr, not --model mlp; drop it");
    let e = refused(&["--model", "ctr", "--table-lr", "0.1"]);
    assert!(e.starts_with("--table-lr applies to the rows of --table-optimizer"), "{e}");
    let e = refused(&["--model", "ctr", "--table-optimizer", "sgd", "--table-lr=-1"]);
    assert_eq!(e, "--table-lr -1 is not a positive learning rate");
    let e = refused(&["--model", "ctr", "--strategy", "multi-worker-mirrored", "--table-optimizer", "adagrad"]);
    assert!(
        e.starts_with(
            "--table-optimizer: local tables (embedding rows in this process) cannot serve multi-worker-mirrored"
        ),
        "{e}"
    );
    for e in [e, refused(&["--model", "ctr", "--table-lr", "0.1"])] {
        assert!(!e.contains('\n') && !e.ends_with('.'), "{e}");
    }
}

/// `--table-optimizer` under one-device and mirrored: the ctr model learns with its table
/// as rows in this process.
#[test]
fn the_ctr_model_learns_with_local_tables() {
    for strategy in ["one-device", "mirrored"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("summary.json");
        let flags = [
            "--model",
            "ctr",
            "--strategy",
            strategy,
            "--table-optimizer",
            "adagrad",
            "--train-records",
            "25600",
            "--test-records",
            "4000",
            "--out",
            out.to_str().unwrap(),
        ];
        crate::train::run(&train_args(&flags)).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let auc = summary["final_test_auc"].as_f64().unwrap();
        eprintln!("{strategy}: auc {auc}");
        assert!(auc > 0.7, "{strategy}: auc {auc}");
        assert_eq!(summary["embedding_rows"], 10_000);
    }
}

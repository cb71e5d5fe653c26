//! Checkpoints: round trips, the latest pointer, retention, and refusal of torn or corrupt
//! files; optimizer state that resumes bitwise.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use strata_core::checkpoint::{
    checkpoint_dir_name, keep_last, latest_checkpoint, optimizer_entries, read_checkpoint, read_latest,
    write_checkpoint, CheckpointTensor, CheckpointWriter, OptimizerState, ShardInfo, LATEST, MANIFEST,
    MANIFEST_CHECKSUM, MODEL_FILE,
};
use strata_core::optim::{FusedAdamW, FusedSgd};
use strata_core::Error;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn cpu() -> Device {
    Device::Cpu
}

fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A small checkpoint of one f32 tensor at `step`.
fn write_simple(root: &Path, step: u64) -> Result<PathBuf, Error> {
    let t = Tensor::new(&[step as f32, 1.0, 2.0, 3.0], &cpu())?;
    write_checkpoint(root, step, &[CheckpointTensor::new("w", t)], &BTreeMap::new())
}

/// Rewrites `dir`'s manifest with `bytes` and its checksum to match, as a writer that
/// produced this manifest would: the checks behind the manifest's checksum still refuse it.
fn write_sealed_manifest(dir: &Path, bytes: &[u8]) -> Result<(), std::io::Error> {
    fs::write(dir.join(MANIFEST), bytes)?;
    fs::write(dir.join(MANIFEST_CHECKSUM), format!("crc32:{:08x}\n", crc32fast::hash(bytes)))
}

/// The text of a `latest` pointer naming `name`, checksum included.
fn pointer(name: &str) -> String {
    format!("{name}\ncrc32:{:08x}\n", crc32fast::hash(name.as_bytes()))
}

fn checkpoint_message(e: Error) -> String {
    match e {
        Error::Checkpoint(m) => m,
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn round_trip_keeps_values_shapes_metadata_versions_and_shards() -> TestResult {
    let root = tempfile::tempdir()?;
    let dev = cpu();
    let matrix = Tensor::arange(0f32, 12.0, &dev)?.reshape((3, 4))?;
    let transposed = matrix.t()?; // non-contiguous: stored in logical (row-major) order
    let entries = vec![
        CheckpointTensor::new("dense/w", matrix.clone()).with_version(7),
        CheckpointTensor::new("dense/w_t", transposed.clone()),
        CheckpointTensor::new("empty", Tensor::zeros((0, 5), DType::F32, &dev)?),
        CheckpointTensor::new("scalar", Tensor::new(-2.5f32, &dev)?).with_version(u64::MAX),
        CheckpointTensor::new("emb/part_1", Tensor::new(&[[1f32, 2.], [3., 4.]], &dev)?)
            .with_version(3)
            .with_shard(ShardInfo { index: 1, count: 3, offset: 4 }),
        CheckpointTensor::new("f64", Tensor::new(&[1e300f64, -0.0], &dev)?),
        CheckpointTensor::new("i64", Tensor::new(&[i64::MIN, 0, i64::MAX], &dev)?),
        CheckpointTensor::new("u32", Tensor::new(&[u32::MAX, 1], &dev)?),
        CheckpointTensor::new("u8", Tensor::new(&[255u8, 0, 7], &dev)?),
        CheckpointTensor::new("f16", Tensor::new(&[0.5f32, -1.25], &dev)?.to_dtype(DType::F16)?),
        CheckpointTensor::new("bf16", Tensor::new(&[3.0f32, -0.125], &dev)?.to_dtype(DType::BF16)?),
    ];
    let metadata = meta(&[("epoch", "3"), ("strategy", "multi-worker-mirrored")]);
    let dir = write_checkpoint(root.path(), 40, &entries, &metadata)?;
    assert_eq!(dir, root.path().join("ckpt-0000000040"));
    assert!(dir.join(MODEL_FILE).is_file() && dir.join(MANIFEST).is_file());
    assert_eq!(fs::read_to_string(root.path().join(LATEST))?, pointer("ckpt-0000000040"));
    assert_eq!(
        fs::read_to_string(dir.join(MANIFEST_CHECKSUM))?,
        format!("crc32:{:08x}\n", crc32fast::hash(&fs::read(dir.join(MANIFEST))?))
    );

    let ckpt = read_checkpoint(&dir)?;
    assert_eq!(ckpt.step, 40);
    assert_eq!(ckpt.metadata, metadata);
    assert!(ckpt.created_unix_ms > 0);
    assert_eq!(ckpt.tensors.len(), entries.len());
    for (want, got) in entries.iter().zip(&ckpt.tensors) {
        assert_eq!(want.name, got.name, "manifest order is kept");
        assert_eq!(want.version, got.version, "{}", want.name);
        assert_eq!(want.shard, got.shard, "{}", want.name);
        assert_eq!(want.tensor.dims(), got.tensor.dims(), "{}", want.name);
        assert_eq!(want.tensor.dtype(), got.tensor.dtype(), "{}", want.name);
        // compare bit patterns through f64 (exact for every dtype here but i64, checked below)
        if want.tensor.dtype() != DType::I64 {
            let a = want.tensor.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            let b = got.tensor.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }
    assert_eq!(ckpt.tensor("i64")?.to_vec1::<i64>()?, vec![i64::MIN, 0, i64::MAX]);
    assert_eq!(ckpt.tensor("dense/w_t")?.to_vec2::<f32>()?, transposed.to_vec2::<f32>()?);
    assert_eq!(ckpt.tensor("scalar")?.to_scalar::<f32>()?, -2.5);
    assert_eq!(ckpt.tensor("empty")?.dims(), &[0, 5]);
    assert_eq!(ckpt.get("emb/part_1").map(|t| t.shard), Some(Some(ShardInfo { index: 1, count: 3, offset: 4 })));
    assert!(ckpt.get("nope").is_none());
    let missing = checkpoint_message(ckpt.tensor("nope").unwrap_err());
    assert!(missing.contains("nope") && missing.contains("ckpt-0000000040"), "{missing}");
    Ok(())
}

#[test]
fn several_files_and_the_same_step_written_twice() -> TestResult {
    let root = tempfile::tempdir()?;
    let dev = cpu();
    let dir = CheckpointWriter::new(root.path(), 5)
        .meta("k", "v")
        .file("model.safetensors", vec![CheckpointTensor::new("w", Tensor::new(&[1f32], &dev)?)])
        .file("optimizer.safetensors", vec![CheckpointTensor::new("opt/t", Tensor::new(3i64, &dev)?)])
        .write()?;
    assert!(dir.join("optimizer.safetensors").is_file());
    let ckpt = read_checkpoint(&dir)?;
    assert_eq!(ckpt.tensor("opt/t")?.to_scalar::<i64>()?, 3);
    assert_eq!(ckpt.metadata, meta(&[("k", "v")]));

    // rewriting step 5 replaces it, and leaves no other directory behind
    let dir2 =
        write_checkpoint(root.path(), 5, &[CheckpointTensor::new("w", Tensor::new(&[2f32], &dev)?)], &meta(&[]))?;
    assert_eq!(dir, dir2);
    let ckpt = read_checkpoint(&dir2)?;
    assert_eq!(ckpt.tensor("w")?.to_vec1::<f32>()?, vec![2.0]);
    assert!(ckpt.get("opt/t").is_none());
    assert!(!dir2.join("optimizer.safetensors").exists());
    let mut names: Vec<_> = fs::read_dir(root.path())?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
    names.sort();
    assert_eq!(names, vec![std::ffi::OsString::from("ckpt-0000000005"), std::ffi::OsString::from(LATEST)]);
    Ok(())
}

#[test]
fn bad_entries_are_refused_before_anything_is_written() -> TestResult {
    let root = tempfile::tempdir()?;
    let t = Tensor::new(&[1f32], &cpu())?;
    let dup = [CheckpointTensor::new("w", t.clone()), CheckpointTensor::new("w", t.clone())];
    let e = checkpoint_message(write_checkpoint(root.path(), 1, &dup, &BTreeMap::new()).unwrap_err());
    assert!(e.contains("\"w\"") && e.contains("unique"), "{e}");
    let shard = [CheckpointTensor::new("w", t.clone()).with_shard(ShardInfo { index: 2, count: 2, offset: 0 })];
    let e = checkpoint_message(write_checkpoint(root.path(), 1, &shard, &BTreeMap::new()).unwrap_err());
    assert!(e.contains("shard index 2 of 2"), "{e}");
    let e = checkpoint_message(
        CheckpointWriter::new(root.path(), 1)
            .file("../evil.safetensors", vec![CheckpointTensor::new("w", t)])
            .write()
            .unwrap_err(),
    );
    assert!(e.contains("invalid file name"), "{e}");
    assert_eq!(fs::read_dir(root.path())?.count(), 0, "nothing was written");
    assert_eq!(latest_checkpoint(root.path())?, None);
    Ok(())
}

#[test]
fn latest_checkpoint_follows_the_pointer_and_ignores_leftovers() -> TestResult {
    let root = tempfile::tempdir()?;
    assert_eq!(latest_checkpoint(&root.path().join("does-not-exist"))?, None);
    assert_eq!(latest_checkpoint(root.path())?, None);
    assert!(read_latest(root.path())?.is_none());
    for step in [10, 30, 20] {
        write_simple(root.path(), step)?;
    }
    // `latest` names the last one written
    assert_eq!(latest_checkpoint(root.path())?, Some(root.path().join(checkpoint_dir_name(20))));

    // a crash mid-write leaves a .tmp directory, even one with a manifest: never the latest
    let leftover = root.path().join(".tmp-ckpt-0000000099-123-456-0");
    fs::create_dir(&leftover)?;
    fs::write(leftover.join(MANIFEST), b"{}")?;
    assert_eq!(latest_checkpoint(root.path())?, Some(root.path().join(checkpoint_dir_name(20))));

    // without the pointer: the highest complete ckpt-* directory
    fs::remove_file(root.path().join(LATEST))?;
    assert_eq!(latest_checkpoint(root.path())?, Some(root.path().join(checkpoint_dir_name(30))));
    // a ckpt-* directory without a manifest is incomplete and skipped
    fs::create_dir(root.path().join(checkpoint_dir_name(50)))?;
    assert_eq!(latest_checkpoint(root.path())?, Some(root.path().join(checkpoint_dir_name(30))));
    // a pointer to a directory that is gone falls back to the scan too
    fs::write(root.path().join(LATEST), pointer("ckpt-0000000077"))?;
    assert_eq!(latest_checkpoint(root.path())?, Some(root.path().join(checkpoint_dir_name(30))));

    let ckpt = read_latest(root.path())?.ok_or("a checkpoint")?;
    assert_eq!(ckpt.step, 30);
    assert_eq!(ckpt.tensor("w")?.to_vec1::<f32>()?, vec![30.0, 1.0, 2.0, 3.0]);
    Ok(())
}

#[test]
fn keep_last_deletes_the_oldest() -> TestResult {
    let root = tempfile::tempdir()?;
    for step in 1..=5 {
        write_simple(root.path(), step * 10)?;
    }
    let e = checkpoint_message(keep_last(root.path(), 0).unwrap_err());
    assert!(e.contains("at least 1"), "{e}");
    let removed = keep_last(root.path(), 2)?;
    assert_eq!(removed, [10, 20, 30].map(|s| root.path().join(checkpoint_dir_name(s))).to_vec());
    let mut left: Vec<_> = fs::read_dir(root.path())?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    left.sort();
    assert_eq!(left, vec!["ckpt-0000000040", "ckpt-0000000050", "latest"]);
    assert!(keep_last(root.path(), 2)?.is_empty());

    // the checkpoint `latest` names is kept even when it is not among the newest
    write_simple(root.path(), 5)?;
    let removed = keep_last(root.path(), 1)?;
    assert_eq!(removed, vec![root.path().join(checkpoint_dir_name(40))]);
    assert_eq!(latest_checkpoint(root.path())?, Some(root.path().join(checkpoint_dir_name(5))));
    assert!(root.path().join(checkpoint_dir_name(50)).is_dir());
    Ok(())
}

#[test]
fn a_truncated_file_is_refused_as_torn() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = write_simple(root.path(), 40)?;
    let file = dir.join(MODEL_FILE);
    let bytes = fs::read(&file)?;
    fs::write(&file, &bytes[..bytes.len() - 3])?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&file.display().to_string()), "{e}");
    assert!(e.contains("length") && e.contains("torn"), "{e}");
    assert!(e.contains(&format!("manifest says {} bytes, file has {}", bytes.len(), bytes.len() - 3)), "{e}");
    Ok(())
}

#[test]
fn a_flipped_byte_is_refused_by_checksum() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = write_simple(root.path(), 40)?;
    let file = dir.join(MODEL_FILE);
    let mut bytes = fs::read(&file)?;
    let last = bytes.len() - 1; // inside the tensor data, which ends the file
    bytes[last] ^= 0x01;
    fs::write(&file, &bytes)?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&file.display().to_string()), "{e}");
    assert!(e.contains("checksum mismatch") && e.contains("corrupt"), "{e}");
    Ok(())
}

#[test]
fn a_tensor_checksum_catches_a_consistent_rewrite() -> TestResult {
    // the file's own checksum is updated in the manifest, the tensor's is not: still refused
    let root = tempfile::tempdir()?;
    let dir = write_simple(root.path(), 40)?;
    let file = dir.join(MODEL_FILE);
    let mut bytes = fs::read(&file)?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    fs::write(&file, &bytes)?;
    let manifest_path = dir.join(MANIFEST);
    let mut manifest: serde_json::Value = serde_json::from_slice(&fs::read(&manifest_path)?)?;
    manifest["files"][0]["crc32"] = serde_json::json!(crc32fast::hash(&bytes));
    write_sealed_manifest(&dir, &serde_json::to_vec(&manifest)?)?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&file.display().to_string()) && e.contains("tensor \"w\""), "{e}");
    assert!(e.contains("checksum mismatch"), "{e}");
    Ok(())
}

#[test]
fn a_garbage_manifest_is_refused_naming_it() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = write_simple(root.path(), 40)?;
    let manifest = dir.join(MANIFEST);
    fs::write(&manifest, b"{\n  \"format\": \"strata-checkpoint/1\",\n  garbage")?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&manifest.display().to_string()), "{e}");
    assert!(e.contains("line 3"), "serde's position is reported: {e}");

    write_sealed_manifest(
        &dir,
        br#"{"format":"strata-checkpoint/9","step":40,"created_unix_ms":0,"metadata":{},"files":[],"tensors":[]}"#,
    )?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&manifest.display().to_string()) && e.contains("strata-checkpoint/9"), "{e}");

    fs::remove_file(&manifest)?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&manifest.display().to_string()) && e.contains("missing"), "{e}");
    Ok(())
}

#[test]
fn a_manifest_listing_a_missing_file_is_refused_naming_it() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = write_simple(root.path(), 40)?;
    let manifest_path = dir.join(MANIFEST);
    let mut manifest: serde_json::Value = serde_json::from_slice(&fs::read(&manifest_path)?)?;
    manifest["files"].as_array_mut().ok_or("files")?.push(serde_json::json!({
        "file": "extra.safetensors", "bytes": 8, "crc32": 0
    }));
    write_sealed_manifest(&dir, &serde_json::to_vec(&manifest)?)?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&dir.join("extra.safetensors").display().to_string()) && e.contains("missing"), "{e}");

    // and a removed model file
    let root = tempfile::tempdir()?;
    let dir = write_simple(root.path(), 41)?;
    fs::remove_file(dir.join(MODEL_FILE))?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&dir.join(MODEL_FILE).display().to_string()) && e.contains("missing"), "{e}");
    Ok(())
}

#[test]
fn a_manifest_that_disagrees_with_the_file_is_refused() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = write_simple(root.path(), 40)?;
    let manifest_path = dir.join(MANIFEST);
    let original = fs::read(&manifest_path)?;
    let mut manifest: serde_json::Value = serde_json::from_slice(&original)?;
    manifest["tensors"][0]["shape"] = serde_json::json!([2, 2]);
    write_sealed_manifest(&dir, &serde_json::to_vec(&manifest)?)?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains("shape [4]") && e.contains("[2, 2]"), "{e}");

    let mut manifest: serde_json::Value = serde_json::from_slice(&original)?;
    manifest["tensors"][0]["name"] = serde_json::json!("v");
    write_sealed_manifest(&dir, &serde_json::to_vec(&manifest)?)?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains("tensor \"v\"") && e.contains("missing"), "{e}");

    let mut manifest: serde_json::Value = serde_json::from_slice(&original)?;
    manifest["step"] = serde_json::json!(41);
    write_sealed_manifest(&dir, &serde_json::to_vec(&manifest)?)?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains("step 41") && e.contains("step 40"), "{e}");
    Ok(())
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    // a small deterministic generator (xorshift), values in [-1, 1)
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Two variables, (4, 3) and (5,), with fixed initial values.
fn fresh_vars() -> Result<Vec<Var>, Error> {
    Ok(vec![Var::from_vec(random(12, 1), (4, 3), &cpu())?, Var::from_vec(random(5, 2), 5, &cpu())?])
}

/// The gradient of step `s` for each variable.
fn step_grads(vars: &[Var], s: u64) -> Result<GradStore, Error> {
    let mut grads = GradStore::default();
    for (i, v) in vars.iter().enumerate() {
        let g = Tensor::from_vec(random(v.elem_count(), 1000 * s + i as u64), v.shape(), &cpu())?;
        grads.insert(v.as_tensor(), g);
    }
    Ok(grads)
}

fn bits(vars: &[Var]) -> Result<Vec<Vec<u32>>, Error> {
    vars.iter().map(|v| Ok(v.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())).collect()
}

/// Runs `k` steps, checkpoints model and optimizer, restores both into fresh objects, and checks
/// that `more` further steps give bitwise the same variables as the run that never stopped.
fn resumes_bitwise<O: Optimizer + OptimizerState>(cfg: O::Config, k: u64, more: u64) -> TestResult
where
    O::Config: Clone,
{
    let root = tempfile::tempdir()?;
    let vars = fresh_vars()?;
    let mut opt = O::new(vars.clone(), cfg.clone())?;
    for s in 0..k {
        opt.step(&step_grads(&vars, s)?)?;
    }
    let mut entries: Vec<_> = vars
        .iter()
        .enumerate()
        .map(|(i, v)| CheckpointTensor::new(format!("var.{i}"), v.as_tensor().clone()))
        .collect();
    entries.extend(optimizer_entries("optimizer/", &opt)?);
    let dir = write_checkpoint(root.path(), k, &entries, &BTreeMap::new())?;

    // the run that never stops
    for s in k..k + more {
        opt.step(&step_grads(&vars, s)?)?;
    }

    // a fresh process: new variables, loaded from the checkpoint, and a new optimizer
    let ckpt = read_checkpoint(&dir)?;
    let restored = fresh_vars()?;
    for (i, v) in restored.iter().enumerate() {
        v.set(ckpt.tensor(&format!("var.{i}"))?)?;
    }
    let mut resumed = O::new(restored.clone(), cfg)?;
    resumed.load_state_tensors(&ckpt.with_prefix("optimizer/"))?;
    for s in k..k + more {
        resumed.step(&step_grads(&restored, s)?)?;
    }
    assert_eq!(bits(&vars)?, bits(&restored)?);
    Ok(())
}

#[test]
fn fused_adamw_resumes_bitwise() -> TestResult {
    resumes_bitwise::<FusedAdamW>(ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() }, 7, 9)
}

#[test]
fn fused_sgd_resumes_bitwise() -> TestResult {
    resumes_bitwise::<FusedSgd>(0.3, 7, 9)
}

#[test]
fn fused_adamw_without_its_state_does_not_resume_bitwise() -> TestResult {
    // the control for the test above: a fresh AdamW (t = 0, zero moments) diverges
    let vars = fresh_vars()?;
    let cfg = ParamsAdamW { lr: 0.01, ..Default::default() };
    let mut opt = FusedAdamW::new(vars.clone(), cfg.clone())?;
    for s in 0..10 {
        opt.step(&step_grads(&vars, s)?)?;
    }
    let restored = fresh_vars()?;
    for (v, r) in vars.iter().zip(&restored) {
        r.set(&v.as_tensor().copy()?)?;
    }
    let mut fresh = FusedAdamW::new(restored.clone(), cfg)?;
    opt.step(&step_grads(&vars, 10)?)?;
    fresh.step(&step_grads(&restored, 10)?)?;
    assert_ne!(bits(&vars)?, bits(&restored)?);
    Ok(())
}

#[test]
fn adamw_state_is_a_snapshot_with_the_documented_names() -> TestResult {
    let vars = fresh_vars()?;
    let mut opt = FusedAdamW::new(vars.clone(), ParamsAdamW::default())?;
    opt.step(&step_grads(&vars, 0)?)?;
    let state = opt.state_tensors()?;
    let names: Vec<_> = state.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["t", "m.0", "v.0", "m.1", "v.1"]);
    assert_eq!(state[0].1.to_scalar::<i64>()?, 1);
    let m0 = state[1].1.flatten_all()?.to_vec1::<f32>()?;
    opt.step(&step_grads(&vars, 1)?)?;
    assert_eq!(state[1].1.flatten_all()?.to_vec1::<f32>()?, m0, "later steps do not change a saved state");
    assert!(FusedSgd::new(vars, 0.1)?.state_tensors()?.is_empty());
    Ok(())
}

#[test]
fn mismatched_optimizer_state_is_a_clear_error_and_changes_nothing() -> TestResult {
    let vars = fresh_vars()?;
    let mut opt = FusedAdamW::new(vars.clone(), ParamsAdamW::default())?;
    opt.step(&step_grads(&vars, 0)?)?;
    let good = opt.state_tensors()?;
    let before: Vec<Vec<f32>> =
        good.iter().map(|(_, t)| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()).collect::<Result<_, _>>()?;

    let mut other = FusedAdamW::new(fresh_vars()?, ParamsAdamW::default())?;
    other.load_state_tensors(&good)?; // same model: fine

    // a shape mismatch on the last moment: error, and the earlier moments are not loaded
    let mut wrong = good.clone();
    wrong[4].1 = Tensor::zeros(4, DType::F32, &cpu())?;
    let mut target = FusedAdamW::new(fresh_vars()?, ParamsAdamW::default())?;
    let e = checkpoint_message(target.load_state_tensors(&wrong).unwrap_err());
    assert!(e.contains("FusedAdamW") && e.contains("\"v.1\"") && e.contains("[4]") && e.contains("[5]"), "{e}");
    let untouched = target.state_tensors()?;
    assert_eq!(untouched[0].1.to_scalar::<i64>()?, 0);
    assert_eq!(untouched[1].1.flatten_all()?.to_vec1::<f32>()?, vec![0.0; 12]);

    let missing: Vec<_> = good.iter().filter(|(n, _)| n != "m.1").cloned().collect();
    let e = checkpoint_message(target.load_state_tensors(&missing).unwrap_err());
    assert!(e.contains("\"m.1\"") && e.contains("missing"), "{e}");

    let mut extra = good.clone();
    extra.push(("m.2".into(), Tensor::zeros(1, DType::F32, &cpu())?));
    let e = checkpoint_message(target.load_state_tensors(&extra).unwrap_err());
    assert!(e.contains("unknown tensor \"m.2\""), "{e}");

    let mut bad_t = good.clone();
    bad_t[0].1 = Tensor::new(1.5f32, &cpu())?;
    let e = checkpoint_message(target.load_state_tensors(&bad_t).unwrap_err());
    assert!(e.contains("\"t\"") && e.contains("integer scalar"), "{e}");

    let mut sgd = FusedSgd::new(fresh_vars()?, 0.1)?;
    sgd.load_state_tensors(&[])?;
    let e = checkpoint_message(sgd.load_state_tensors(&good).unwrap_err());
    assert!(e.contains("FusedSgd") && e.contains("\"t\""), "{e}");

    // the source optimizer's state is unchanged by all of this
    let after: Vec<Vec<f32>> = opt
        .state_tensors()?
        .iter()
        .map(|(_, t)| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>())
        .collect::<Result<_, _>>()?;
    assert_eq!(before, after);
    Ok(())
}

/// Every regular file a restore of `root` reads: `latest` and the files of the checkpoint it
/// names.
fn files_a_restore_reads(root: &Path) -> Result<Vec<PathBuf>, std::io::Error> {
    let dir = latest_checkpoint(root).map_err(std::io::Error::other)?.ok_or(std::io::ErrorKind::NotFound)?;
    let mut files = vec![root.join(LATEST)];
    for e in fs::read_dir(&dir)? {
        files.push(e?.path());
    }
    files.sort();
    Ok(files)
}

/// Flips every byte of every file a restore reads, one at a time (three ways each), and
/// checks that each is refused by a checkpoint error naming a file of the checkpoint, and that
/// the untouched checkpoint still reads.
fn every_flipped_byte_is_refused(root: &Path) -> TestResult {
    let files = files_a_restore_reads(root)?;
    assert!(files.len() >= 4, "latest, the manifest, its checksum and a safetensors file: {files:?}");
    let mut refused = 0usize;
    for file in &files {
        let original = fs::read(file)?;
        for at in 0..original.len() {
            for mask in [0x01u8, 0x20, 0x80] {
                let mut bytes = original.clone();
                bytes[at] ^= mask;
                fs::write(file, &bytes)?;
                match read_latest(root) {
                    Ok(_) => panic!("{}: byte {at} ^ {mask:#04x} was not refused", file.display()),
                    Err(Error::Checkpoint(m)) => {
                        assert!(m.contains(&root.display().to_string()), "the error names the checkpoint: {m}");
                        refused += 1;
                    }
                    Err(other) => {
                        panic!("{}: byte {at} ^ {mask:#04x}: not a checkpoint error: {other}", file.display())
                    }
                }
            }
        }
        fs::write(file, &original)?;
    }
    let total: usize = files.iter().map(|f| fs::metadata(f).map(|m| m.len() as usize)).sum::<Result<_, _>>()?;
    assert_eq!(refused, 3 * total);
    assert!(read_latest(root)?.is_some(), "the restored files read again");
    Ok(())
}

#[test]
fn every_byte_of_every_file_a_restore_reads_is_covered() -> TestResult {
    let root = tempfile::tempdir()?;
    let dev = cpu();
    let vars = fresh_vars()?;
    let mut opt = FusedAdamW::new(vars.clone(), ParamsAdamW { lr: 0.007, ..Default::default() })?;
    opt.step(&step_grads(&vars, 0)?)?;
    let mut entries: Vec<_> = vars
        .iter()
        .enumerate()
        .map(|(i, v)| CheckpointTensor::new(format!("model/{i}"), v.as_tensor().clone()).with_version(96))
        .collect();
    entries.extend(optimizer_entries("optimizer/", &opt)?);
    entries.push(CheckpointTensor::new("shard", Tensor::new(&[1f32, 2.], &dev)?).with_shard(ShardInfo {
        index: 1,
        count: 2,
        offset: 3,
    }));
    write_checkpoint(root.path(), 96, &entries, &meta(&[("lr", "0.007"), ("strategy", "mirrored")]))?;
    every_flipped_byte_is_refused(root.path())
}

#[test]
fn an_edited_manifest_is_refused_by_its_checksum() -> TestResult {
    let root = tempfile::tempdir()?;
    let t = Tensor::new(&[1f32, 2.0], &cpu())?;
    let dir =
        write_checkpoint(root.path(), 7, &[CheckpointTensor::new("w", t).with_version(96)], &meta(&[("lr", "0.007")]))?;
    let manifest = dir.join(MANIFEST);
    let text = fs::read_to_string(&manifest)?;
    // Valid JSON with another learning rate and another version: what a flipped bit can give.
    for (from, to) in [("0.007", "0.005"), ("\"version\": 96", "\"version\": 98")] {
        assert!(text.contains(from), "{text}");
        fs::write(&manifest, text.replace(from, to))?;
        let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
        assert!(e.contains(&manifest.display().to_string()) && e.contains("checksum mismatch"), "{e}");
        assert!(e.contains(MANIFEST_CHECKSUM) && e.contains("corrupt"), "{e}");
    }
    fs::write(&manifest, &text)?;
    assert_eq!(read_checkpoint(&dir)?.metadata, meta(&[("lr", "0.007")]));

    fs::remove_file(dir.join(MANIFEST_CHECKSUM))?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains(&dir.join(MANIFEST_CHECKSUM).display().to_string()) && e.contains("missing"), "{e}");

    // A checkpoint of the format before the manifest had a checksum cannot be verified.
    write_sealed_manifest(&dir, text.replace("strata-checkpoint/2", "strata-checkpoint/1").as_bytes())?;
    let e = checkpoint_message(read_checkpoint(&dir).unwrap_err());
    assert!(e.contains("\"strata-checkpoint/1\" is not supported"), "{e}");
    Ok(())
}

#[test]
fn a_corrupt_latest_pointer_is_refused() -> TestResult {
    let root = tempfile::tempdir()?;
    write_simple(root.path(), 40)?;
    write_simple(root.path(), 41)?;
    // One digit off names the other checkpoint: refused, never read in its place.
    fs::write(root.path().join(LATEST), "ckpt-0000000040\ncrc32:00000000\n")?;
    let e = checkpoint_message(read_latest(root.path()).unwrap_err());
    assert!(e.contains(&root.path().join(LATEST).display().to_string()) && e.contains("checksum"), "{e}");
    fs::write(root.path().join(LATEST), "ckpt-0000000040\n")?;
    assert!(read_latest(root.path()).is_err(), "a pointer without its checksum is refused");
    fs::write(root.path().join(LATEST), pointer("ckpt-0000000040"))?;
    assert_eq!(read_latest(root.path())?.map(|c| c.step), Some(40));
    Ok(())
}

/// A directory this process cannot write: mode 0555 for a user, `/sys/kernel` (sysfs) for
/// root, whom file modes do not stop.
fn unwritable_dir(tmp: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp.join("read-only");
    fs::create_dir_all(&dir).expect("a temporary directory");
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o555)).expect("chmod");
    if fs::File::create(dir.join("probe")).is_ok() {
        return PathBuf::from("/sys/kernel");
    }
    dir
}

#[test]
fn check_writable_creates_the_root_and_refuses_what_cannot_be_written() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let nested = tmp.path().join("a/b/ckpts");
    strata_core::checkpoint::check_writable(&nested)?;
    assert!(nested.is_dir());
    assert_eq!(fs::read_dir(&nested)?.count(), 0, "the probe is removed");

    let ro = unwritable_dir(tmp.path());
    let e = checkpoint_message(strata_core::checkpoint::check_writable(&ro).unwrap_err());
    assert!(e.contains(&ro.display().to_string()) && e.contains("cannot write a file in it"), "{e}");

    let file = tmp.path().join("plain-file");
    fs::write(&file, b"x")?;
    let e = checkpoint_message(strata_core::checkpoint::check_writable(&file).unwrap_err());
    assert!(e.contains(&file.display().to_string()), "{e}");
    Ok(())
}

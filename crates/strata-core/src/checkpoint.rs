//! Atomic, verified checkpoints: safetensors files plus a manifest, as DESIGN.md §6 asks.
//!
//! A checkpoint is a directory `<root>/ckpt-<step:010>/` holding one or more safetensors files,
//! a `manifest.json` that lists every file (byte length and crc32) and every tensor (file,
//! shape, dtype, version, shard, crc32 of its bytes) beside the writer's metadata, and
//! `manifest.crc32`, the crc32 of the manifest's bytes. Writing is atomic: everything goes into a
//! temporary sibling directory (`.tmp-ckpt-...`), every file and the directory are fsynced, the
//! directory is renamed to its final name, the root is fsynced, and only then is `<root>/latest`
//! replaced (temporary file, fsync, rename). A crash at any point leaves either the previous
//! checkpoint or the new one as the latest, never a half-written one; `.tmp-*` leftovers are
//! ignored by the readers.
//!
//! **Every byte a restore reads is covered by a checksum**: the tensors and the safetensors
//! headers by the crc32 of each file (and of each tensor) in the manifest, the manifest (the
//! step, the metadata, the listed checksums) by `manifest.crc32`, whose own bytes must be
//! exactly the text this code writes for the manifest (`crc32:<8 hex digits>` and a newline),
//! and `<root>/latest` by the crc32 of the name it holds (`ckpt-<step>`, a newline,
//! `crc32:<8 hex digits>`, a newline). A byte changed anywhere, metadata included, is refused.
//!
//! Reading verifies everything before returning anything: the manifest parses, has the
//! format this code writes and matches its checksum, every file exists with the listed length
//! (a torn file) and crc32 (a flipped bit), the safetensors header parses, and every tensor is
//! present with the listed shape, dtype and crc32. Errors are [`Error::Checkpoint`] naming the
//! file and what to do.
//!
//! ```
//! use std::collections::BTreeMap;
//! use candle_core::{Device, Tensor};
//! use strata_core::checkpoint::{latest_checkpoint, read_checkpoint, write_checkpoint, CheckpointTensor};
//!
//! let root = std::env::temp_dir().join(format!("strata-doc-ckpt-{}", std::process::id()));
//! let w = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
//! let meta = BTreeMap::from([("epoch".to_string(), "3".to_string())]);
//! let dir = write_checkpoint(&root, 40, &[CheckpointTensor::new("w", w)], &meta)?;
//! assert_eq!(latest_checkpoint(&root)?, Some(dir.clone()));
//! let ckpt = read_checkpoint(&dir)?;
//! assert_eq!(ckpt.step, 40);
//! assert_eq!(ckpt.tensor("w")?.to_vec1::<f32>()?, vec![1., 2., 3.]);
//! # std::fs::remove_dir_all(&root).ok();
//! # Ok::<(), strata_core::Error>(())
//! ```

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, View};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The `format` field this code writes and reads. Format 1 (before the manifest had a
/// checksum of its own) is refused: its metadata cannot be verified.
pub const FORMAT: &str = "strata-checkpoint/2";
/// The name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// The name of the file beside the manifest that holds its checksum ([`manifest_checksum`]).
pub const MANIFEST_CHECKSUM: &str = "manifest.crc32";
/// The name of the file in the root that names the latest checkpoint directory.
pub const LATEST: &str = "latest";
/// The safetensors file [`write_checkpoint`] writes.
pub const MODEL_FILE: &str = "model.safetensors";

const DIR_PREFIX: &str = "ckpt-";
const TMP_PREFIX: &str = ".tmp-";

/// Where a tensor sits in a variable split along its first axis (a parameter-server shard).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// This shard's index, `0..count`.
    pub index: usize,
    /// How many shards the variable is split into.
    pub count: usize,
    /// The first row of the whole variable that this shard holds.
    pub offset: usize,
}

/// One tensor to write: its name (unique in the checkpoint), value, version and shard.
#[derive(Debug, Clone)]
pub struct CheckpointTensor {
    /// The tensor's name, unique within the checkpoint.
    pub name: String,
    /// The value; any device, copied to the host when written.
    pub tensor: Tensor,
    /// The variable's version (the number of updates applied), 0 where it does not apply.
    pub version: u64,
    /// Which shard of a partitioned variable this is, if any.
    pub shard: Option<ShardInfo>,
}

impl CheckpointTensor {
    /// A tensor at version 0 and not sharded.
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Self {
        Self { name: name.into(), tensor, version: 0, shard: None }
    }

    /// Sets the version.
    pub fn with_version(mut self, version: u64) -> Self {
        self.version = version;
        self
    }

    /// Sets the shard.
    pub fn with_shard(mut self, shard: ShardInfo) -> Self {
        self.shard = Some(shard);
        self
    }
}

/// One file of a checkpoint as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// The file's name inside the checkpoint directory.
    pub file: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// The crc32 (IEEE) of its bytes.
    pub crc32: u32,
}

/// One tensor of a checkpoint as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestTensor {
    /// The tensor's name, unique within the checkpoint and the key inside its file.
    pub name: String,
    /// The file that holds it.
    pub file: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype, as candle names it (`f32`, `bf16`, `i64`, ...).
    pub dtype: String,
    /// The variable's version.
    pub version: u64,
    /// The shard, or null.
    pub shard: Option<ShardInfo>,
    /// The crc32 (IEEE) of the tensor's bytes (little endian, row major).
    pub crc32: u32,
}

/// `manifest.json`: what a checkpoint holds and the checksums to verify it by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// The training step the checkpoint was taken at.
    pub step: u64,
    /// When it was written, in milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Free-form metadata from the writer.
    pub metadata: BTreeMap<String, String>,
    /// The files, with their lengths and checksums.
    pub files: Vec<ManifestFile>,
    /// The tensors.
    pub tensors: Vec<ManifestTensor>,
}

/// A tensor read back from a checkpoint.
#[derive(Debug, Clone)]
pub struct LoadedTensor {
    /// Its name.
    pub name: String,
    /// Its value, on the CPU.
    pub tensor: Tensor,
    /// The version it was written with.
    pub version: u64,
    /// The shard it was written with.
    pub shard: Option<ShardInfo>,
}

/// A checkpoint read and verified by [`read_checkpoint`].
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The directory it was read from.
    pub dir: PathBuf,
    /// The training step.
    pub step: u64,
    /// When it was written, in milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The writer's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Every tensor, in manifest order.
    pub tensors: Vec<LoadedTensor>,
}

impl Checkpoint {
    /// The tensor called `name`, if the checkpoint holds one.
    pub fn get(&self, name: &str) -> Option<&LoadedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The value of the tensor called `name`, or an error naming the checkpoint.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.get(name).map(|t| &t.tensor).ok_or_else(|| {
            Error::Checkpoint(format!(
                "{}: no tensor named {name:?}; the checkpoint holds {} tensors (was it written by another model?)",
                self.dir.display(),
                self.tensors.len()
            ))
        })
    }

    /// The tensors whose names start with `prefix`, with the prefix removed: the shape
    /// [`OptimizerState::load_state_tensors`] takes, for state written under a prefix.
    pub fn with_prefix(&self, prefix: &str) -> Vec<(String, Tensor)> {
        self.tensors
            .iter()
            .filter_map(|t| t.name.strip_prefix(prefix).map(|rest| (rest.to_string(), t.tensor.clone())))
            .collect()
    }
}

/// An optimizer whose internal state (moments, step counts) can be saved and restored, so that
/// training resumed from a checkpoint makes bitwise the same updates as training that never
/// stopped.
pub trait OptimizerState {
    /// A snapshot of the state as named tensors (copies, unaffected by later steps).
    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>>;

    /// Restores the state from tensors returned by [`state_tensors`](Self::state_tensors) of an
    /// optimizer over the same variables. Missing, unknown or mis-shaped tensors are an error,
    /// and then nothing is changed.
    fn load_state_tensors(&mut self, state: &[(String, Tensor)]) -> Result<()>;

    /// An optimizer of the same settings (its learning rate as it is now) over `vars`, with
    /// fresh state, or `None` for one that cannot make one. ZeRO re-splits an elastic job's
    /// shards over a new membership with it, then loads the state cut to the new shards.
    fn renew(&self, vars: Vec<candle_core::Var>) -> Option<Result<Self>>
    where
        Self: Sized,
    {
        let _ = vars;
        None
    }
}

/// The entries for an optimizer's state, each name prefixed by `prefix` (for instance
/// `"optimizer/"`), ready to be written beside the model's tensors.
pub fn optimizer_entries(prefix: &str, optimizer: &impl OptimizerState) -> Result<Vec<CheckpointTensor>> {
    Ok(optimizer
        .state_tensors()?
        .into_iter()
        .map(|(name, tensor)| CheckpointTensor::new(format!("{prefix}{name}"), tensor))
        .collect())
}

/// The directory name of the checkpoint of `step`: `ckpt-<step:010>`.
pub fn checkpoint_dir_name(step: u64) -> String {
    format!("{DIR_PREFIX}{step:010}")
}

/// The step a checkpoint directory name stands for, if it is one (`ckpt-` and digits).
fn parse_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(DIR_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The text of [`MANIFEST_CHECKSUM`] for a manifest of these bytes: `crc32:<8 lower-case hex
/// digits>` and a newline. A reader accepts exactly this text and nothing else.
pub fn manifest_checksum(manifest: &[u8]) -> String {
    format!("crc32:{:08x}\n", crc32fast::hash(manifest))
}

/// The text of `<root>/latest` naming the checkpoint directory `name`: the name, a newline,
/// `crc32:<8 hex digits>` of the name, a newline.
fn pointer_text(name: &str) -> String {
    format!("{name}\ncrc32:{:08x}\n", crc32fast::hash(name.as_bytes()))
}

/// Checks that `root` is (or can be made) a checkpoint root this process can write: creates it
/// if missing, then creates, writes, fsyncs and removes a temporary file in it. Call it before
/// training starts, so that a directory that cannot take a checkpoint fails at once rather than
/// at the first checkpoint.
pub fn check_writable(root: &Path) -> Result<()> {
    let refuse = |what: &str, e: std::io::Error| {
        Error::Checkpoint(format!(
            "{}: {what} ({e}); checkpoints cannot be written there, give a directory this process can write",
            root.display()
        ))
    };
    fs::create_dir_all(root).map_err(|e| refuse("cannot create the directory", e))?;
    if !root.is_dir() {
        return Err(Error::Checkpoint(format!(
            "{}: not a directory; give a directory for the checkpoints",
            root.display()
        )));
    }
    let probe = root.join(unique_name(&format!("{TMP_PREFIX}writable")));
    let written = File::create(&probe).and_then(|mut f| {
        f.write_all(b"strata")?;
        f.sync_all()
    });
    let removed = if probe.exists() { fs::remove_file(&probe) } else { Ok(()) };
    written.map_err(|e| refuse("cannot write a file in it", e))?;
    removed.map_err(|e| refuse("cannot remove a file from it", e))
}

/// Writes a checkpoint of `step` under `root` with every entry in one file,
/// [`MODEL_FILE`], and returns its directory. See [`CheckpointWriter`] for several files.
pub fn write_checkpoint(
    root: &Path,
    step: u64,
    entries: &[CheckpointTensor],
    metadata: &BTreeMap<String, String>,
) -> Result<PathBuf> {
    let mut writer = CheckpointWriter::new(root, step);
    writer.metadata = metadata.clone();
    writer.file(MODEL_FILE, entries.to_vec()).write()
}

/// Builds a checkpoint of several safetensors files, written atomically by
/// [`write`](Self::write).
#[derive(Debug, Clone)]
pub struct CheckpointWriter {
    root: PathBuf,
    step: u64,
    /// Free-form metadata stored in the manifest.
    pub metadata: BTreeMap<String, String>,
    files: Vec<(String, Vec<CheckpointTensor>)>,
}

impl CheckpointWriter {
    /// A checkpoint of `step` under `root` (created if missing), with no files yet.
    pub fn new(root: impl Into<PathBuf>, step: u64) -> Self {
        Self { root: root.into(), step, metadata: BTreeMap::new(), files: Vec::new() }
    }

    /// Adds a metadata entry.
    pub fn meta(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Adds a safetensors file (a plain name such as `optimizer.safetensors`) holding `entries`.
    pub fn file(mut self, name: impl Into<String>, entries: Vec<CheckpointTensor>) -> Self {
        self.files.push((name.into(), entries));
        self
    }

    /// Writes the checkpoint atomically and points `<root>/latest` at it; returns its
    /// directory. An existing checkpoint of the same step is replaced.
    pub fn write(self) -> Result<PathBuf> {
        let Self { root, step, metadata, files } = self;
        let final_dir = root.join(checkpoint_dir_name(step));
        let prepared = prepare_files(&final_dir, &files)?;
        fs::create_dir_all(&root).map_err(|e| ckpt_io(&root, "cannot create the checkpoint root directory", e))?;
        let tmp = root.join(unique_name(&format!("{TMP_PREFIX}ckpt-{step:010}")));
        fs::create_dir(&tmp).map_err(|e| ckpt_io(&tmp, "cannot create the temporary checkpoint directory", e))?;
        let result = write_into(&tmp, step, metadata, &prepared).and_then(|()| publish(&root, &tmp, &final_dir));
        if result.is_err() && tmp.exists() {
            if let Err(e) = fs::remove_dir_all(&tmp) {
                tracing::warn!(dir = %tmp.display(), error = %e, "cannot remove a failed checkpoint's temporary directory");
            }
        }
        result.map(|()| final_dir)
    }
}

/// One tensor turned into bytes, ready for safetensors.
struct HostTensor {
    dtype: StDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &HostTensor {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

struct PreparedFile {
    name: String,
    tensors: Vec<(CheckpointTensor, HostTensor)>,
}

/// Validates the names and turns every tensor into host bytes before anything touches disk.
fn prepare_files(final_dir: &Path, files: &[(String, Vec<CheckpointTensor>)]) -> Result<Vec<PreparedFile>> {
    if files.is_empty() {
        return Err(Error::Checkpoint(format!(
            "{}: a checkpoint needs at least one file; add one with CheckpointWriter::file",
            final_dir.display()
        )));
    }
    let mut file_names = BTreeSet::new();
    let mut tensor_names = BTreeSet::new();
    let mut prepared = Vec::with_capacity(files.len());
    for (file, entries) in files {
        check_file_name(final_dir, file)?;
        if !file_names.insert(file.as_str()) {
            return Err(Error::Checkpoint(format!(
                "{}: file {file:?} is added twice; give each file one name",
                final_dir.display()
            )));
        }
        let mut tensors = Vec::with_capacity(entries.len());
        for entry in entries {
            let at = || format!("{}: tensor {:?}", final_dir.join(file).display(), entry.name);
            if entry.name.is_empty() || entry.name == "__metadata__" {
                return Err(Error::Checkpoint(format!("{}: invalid tensor name; use a non-empty name", at())));
            }
            if !tensor_names.insert(entry.name.as_str()) {
                return Err(Error::Checkpoint(format!(
                    "{}: the name is used twice in the checkpoint; tensor names must be unique",
                    at()
                )));
            }
            if let Some(s) = entry.shard {
                if s.count == 0 || s.index >= s.count {
                    return Err(Error::Checkpoint(format!(
                        "{}: shard index {} of {} is out of range; the index must be below the count",
                        at(),
                        s.index,
                        s.count
                    )));
                }
            }
            let host = host_tensor(&entry.tensor).map_err(|e| Error::Checkpoint(format!("{}: {e}", at())))?;
            tensors.push((entry.clone(), host));
        }
        prepared.push(PreparedFile { name: file.clone(), tensors });
    }
    Ok(prepared)
}

/// A file name inside a checkpoint must be a plain name ending in `.safetensors`.
fn check_file_name(dir: &Path, file: &str) -> Result<()> {
    let plain = !file.is_empty()
        && file != MANIFEST
        && !file.starts_with('.')
        && !file.contains(['/', '\\'])
        && Path::new(file).file_name().is_some_and(|n| n == file);
    if plain && file.ends_with(".safetensors") {
        Ok(())
    } else {
        Err(Error::Checkpoint(format!(
            "{}: invalid file name {file:?}; use a plain name ending in .safetensors",
            dir.display()
        )))
    }
}

/// The tensor's elements as little-endian bytes in row-major order, copied to the host.
fn host_tensor(tensor: &Tensor) -> std::result::Result<HostTensor, String> {
    let shape = tensor.dims().to_vec();
    let dtype = tensor.dtype();
    let st_dtype = match dtype {
        DType::U8
        | DType::U32
        | DType::I16
        | DType::I32
        | DType::I64
        | DType::BF16
        | DType::F16
        | DType::F32
        | DType::F64 => StDtype::from(dtype),
        other => return Err(format!("dtype {} is not supported in checkpoints; convert it to f32", other.as_str())),
    };
    let host = tensor
        .to_device(&Device::Cpu)
        .and_then(|t| t.contiguous())
        .map_err(|e| format!("cannot copy the tensor to the host: {e}"))?;
    let (storage, layout) = host.storage_and_layout();
    let Some((lo, hi)) = layout.contiguous_offsets() else {
        return Err("the tensor is not contiguous after copying it to the host".to_string());
    };
    let Storage::Cpu(cpu) = &*storage else {
        return Err("the tensor is not on the host after copying it there".to_string());
    };
    fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|x| f(*x)).collect()
    }
    let bytes = match cpu {
        CpuStorage::U8(v) => v[lo..hi].to_vec(),
        CpuStorage::U32(v) => le(&v[lo..hi], u32::to_le_bytes),
        CpuStorage::I16(v) => le(&v[lo..hi], i16::to_le_bytes),
        CpuStorage::I32(v) => le(&v[lo..hi], i32::to_le_bytes),
        CpuStorage::I64(v) => le(&v[lo..hi], i64::to_le_bytes),
        CpuStorage::BF16(v) => le(&v[lo..hi], |x| x.to_le_bytes()),
        CpuStorage::F16(v) => le(&v[lo..hi], |x| x.to_le_bytes()),
        CpuStorage::F32(v) => le(&v[lo..hi], f32::to_le_bytes),
        CpuStorage::F64(v) => le(&v[lo..hi], f64::to_le_bytes),
        _ => return Err(format!("dtype {} is not supported in checkpoints; convert it to f32", dtype.as_str())),
    };
    Ok(HostTensor { dtype: st_dtype, shape, bytes })
}

/// Writes the files and the manifest into `tmp`, fsyncing each file and the directory.
fn write_into(tmp: &Path, step: u64, metadata: BTreeMap<String, String>, files: &[PreparedFile]) -> Result<()> {
    let mut manifest = Manifest {
        format: FORMAT.to_string(),
        step,
        created_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
        metadata,
        files: Vec::with_capacity(files.len()),
        tensors: Vec::new(),
    };
    for file in files {
        let path = tmp.join(&file.name);
        let views = file.tensors.iter().map(|(entry, host)| (entry.name.as_str(), host));
        safetensors::serialize_to_file(views, None, &path)
            .map_err(|e| Error::Checkpoint(format!("{}: cannot write the safetensors file: {e}", path.display())))?;
        let (bytes, crc32) = sync_and_checksum(&path)?;
        manifest.files.push(ManifestFile { file: file.name.clone(), bytes, crc32 });
        for (entry, host) in &file.tensors {
            manifest.tensors.push(ManifestTensor {
                name: entry.name.clone(),
                file: file.name.clone(),
                shape: host.shape.clone(),
                dtype: entry.tensor.dtype().as_str().to_string(),
                version: entry.version,
                shard: entry.shard,
                crc32: crc32fast::hash(&host.bytes),
            });
        }
    }
    let path = tmp.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| Error::Checkpoint(format!("{}: cannot encode the manifest: {e}", path.display())))?;
    write_synced(&tmp.join(MANIFEST_CHECKSUM), manifest_checksum(&json).as_bytes())?;
    write_synced(&path, &json)?;
    sync_dir(tmp)
}

/// Renames the finished temporary directory to its final name (moving an old checkpoint of
/// the same step aside first), fsyncs the root, and then points `latest` at it.
fn publish(root: &Path, tmp: &Path, final_dir: &Path) -> Result<()> {
    let mut aside = None;
    if final_dir.exists() {
        let old = root.join(unique_name(&format!("{TMP_PREFIX}replaced-{}", dir_name(final_dir))));
        fs::rename(final_dir, &old)
            .map_err(|e| ckpt_io(final_dir, "cannot move the existing checkpoint of this step aside", e))?;
        aside = Some(old);
    }
    if let Err(e) = fs::rename(tmp, final_dir) {
        if let Some(old) = &aside {
            fs::rename(old, final_dir).ok();
        }
        return Err(ckpt_io(final_dir, "cannot rename the new checkpoint into place", e));
    }
    sync_dir(root)?;
    if let Some(old) = aside {
        if let Err(e) = fs::remove_dir_all(&old) {
            tracing::warn!(dir = %old.display(), error = %e, "cannot remove a replaced checkpoint");
        }
    }
    let latest_tmp = root.join(unique_name(&format!("{TMP_PREFIX}{LATEST}")));
    write_synced(&latest_tmp, pointer_text(&dir_name(final_dir)).as_bytes())?;
    let latest = root.join(LATEST);
    if let Err(e) = fs::rename(&latest_tmp, &latest) {
        fs::remove_file(&latest_tmp).ok();
        return Err(ckpt_io(&latest, "cannot replace the latest-checkpoint pointer", e));
    }
    sync_dir(root)
}

fn dir_name(dir: &Path) -> String {
    dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// `<prefix>-<pid>-<nanos>-<counter>`: unique across processes and threads.
fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{nanos}-{n}", std::process::id())
}

fn ckpt_io(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Checkpoint(format!("{}: {what}: {e}", path.display()))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| ckpt_io(path, "cannot create", e))?;
    f.write_all(bytes).map_err(|e| ckpt_io(path, "cannot write", e))?;
    f.sync_all().map_err(|e| ckpt_io(path, "cannot fsync", e))
}

/// Fsyncs a file written by someone else and returns its length and crc32, read back.
fn sync_and_checksum(path: &Path) -> Result<(u64, u32)> {
    let mut f = File::open(path).map_err(|e| ckpt_io(path, "cannot reopen the written file", e))?;
    f.sync_all().map_err(|e| ckpt_io(path, "cannot fsync", e))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| ckpt_io(path, "cannot read back the written file", e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    Ok((len, hasher.finalize()))
}

/// Fsyncs a directory so that the names created or renamed in it are durable.
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let f = File::open(dir).map_err(|e| ckpt_io(dir, "cannot open the directory to fsync it", e))?;
        f.sync_all().map_err(|e| ckpt_io(dir, "cannot fsync the directory", e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// The complete checkpoints (`ckpt-<step>` directories with a manifest) under `root`, by step.
fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ckpt_io(root, "cannot list the checkpoint root", e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| ckpt_io(root, "cannot list the checkpoint root", e))?;
        let name = entry.file_name();
        let Some(step) = name.to_str().and_then(parse_dir_name) else { continue };
        let path = entry.path();
        if path.join(MANIFEST).is_file() {
            found.push((step, path));
        }
    }
    found.sort();
    Ok(found)
}

/// The complete checkpoints under `root` (`ckpt-<step>` directories with a manifest), by
/// ascending step; empty when there is none (or no root). Nothing is read or verified: a
/// restore reads the one it picks.
pub fn checkpoint_steps(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    list_checkpoints(root)
}

/// The directory `<root>/latest` names, if the file exists and names a complete checkpoint.
/// A pointer that does not match its checksum (or is not of the form this code writes) is
/// refused: it would otherwise name another checkpoint than the latest.
fn latest_pointer(root: &Path) -> Result<Option<PathBuf>> {
    let path = root.join(LATEST);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ckpt_io(&path, "cannot read the latest-checkpoint pointer", e)),
    };
    let name = std::str::from_utf8(&bytes).ok().and_then(|t| t.split_once('\n')).map(|(name, _)| name);
    let Some(name) = name.filter(|n| parse_dir_name(n).is_some() && pointer_text(n).as_bytes() == bytes) else {
        return Err(Error::Checkpoint(format!(
            "{}: the latest-checkpoint pointer does not match its checksum; it is corrupt, delete it to restore from the newest complete checkpoint",
            path.display()
        )));
    };
    let dir = root.join(name);
    if dir.join(MANIFEST).is_file() {
        Ok(Some(dir))
    } else {
        tracing::warn!(file = %path.display(), dir = %dir.display(), "the latest-checkpoint pointer names a missing or incomplete checkpoint; scanning the root instead");
        Ok(None)
    }
}

/// The latest checkpoint under `root`: the one `<root>/latest` names, or, when that file is
/// missing or names no complete checkpoint, the complete `ckpt-*` directory of the highest
/// step. `.tmp-*` leftovers of interrupted writes are never returned; `None` when there is
/// no checkpoint (or no root).
pub fn latest_checkpoint(root: &Path) -> Result<Option<PathBuf>> {
    if let Some(dir) = latest_pointer(root)? {
        return Ok(Some(dir));
    }
    Ok(list_checkpoints(root)?.pop().map(|(_, dir)| dir))
}

/// Reads and verifies the latest checkpoint under `root`, if any.
pub fn read_latest(root: &Path) -> Result<Option<Checkpoint>> {
    latest_checkpoint(root)?.map(|dir| read_checkpoint(&dir)).transpose()
}

/// Deletes all but the `k` most recent complete checkpoints under `root` (and never the one
/// `latest` names); returns the directories removed. Each is renamed to a `.tmp-*` name before
/// it is deleted, so a crash never leaves a half-deleted checkpoint under a `ckpt-*` name.
pub fn keep_last(root: &Path, k: usize) -> Result<Vec<PathBuf>> {
    if k == 0 {
        return Err(Error::Checkpoint(format!(
            "{}: keep_last needs k of at least 1; keeping no checkpoint would delete the latest",
            root.display()
        )));
    }
    let all = list_checkpoints(root)?;
    let latest = latest_pointer(root)?;
    let cut = all.len().saturating_sub(k);
    let mut removed = Vec::new();
    for (_, dir) in all.into_iter().take(cut) {
        if latest.as_deref() == Some(dir.as_path()) {
            continue;
        }
        let aside = root.join(unique_name(&format!("{TMP_PREFIX}removing-{}", dir_name(&dir))));
        fs::rename(&dir, &aside).map_err(|e| ckpt_io(&dir, "cannot move an old checkpoint aside to delete it", e))?;
        fs::remove_dir_all(&aside).map_err(|e| ckpt_io(&aside, "cannot delete an old checkpoint", e))?;
        removed.push(dir);
    }
    if !removed.is_empty() {
        sync_dir(root)?;
    }
    Ok(removed)
}

/// Reads and parses `<dir>/manifest.json` without reading the tensors, and verifies it against
/// `<dir>/manifest.crc32`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Checkpoint(format!(
                "{}: missing; this is not a complete checkpoint directory (restore from another checkpoint)",
                path.display()
            )))
        }
        Err(e) => return Err(ckpt_io(&path, "cannot read the manifest", e)),
    };
    let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
        Error::Checkpoint(format!(
            "{}: not a valid checkpoint manifest: {e}; the checkpoint is corrupt, restore from an older one or delete it",
            path.display()
        ))
    })?;
    if manifest.format != FORMAT {
        return Err(Error::Checkpoint(format!(
            "{}: format {:?} is not supported; this version of strata reads {FORMAT:?}",
            path.display(),
            manifest.format
        )));
    }
    let sum_path = dir.join(MANIFEST_CHECKSUM);
    let sum = match fs::read(&sum_path) {
        Ok(sum) => sum,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Checkpoint(format!(
                "{}: missing, so the manifest cannot be verified; the checkpoint is incomplete, restore from an older one or delete it",
                sum_path.display()
            )))
        }
        Err(e) => return Err(ckpt_io(&sum_path, "cannot read the manifest's checksum", e)),
    };
    let expected = manifest_checksum(&bytes);
    if sum != expected.as_bytes() {
        return Err(Error::Checkpoint(format!(
            "{}: checksum mismatch ({} says {:?}, the manifest has {:?}); the checkpoint is corrupt, restore from an older one or delete it",
            path.display(),
            MANIFEST_CHECKSUM,
            String::from_utf8_lossy(&sum[..sum.len().min(32)]).trim_end(),
            expected.trim_end()
        )));
    }
    Ok(manifest)
}

/// Reads the checkpoint in `dir` and verifies every file and tensor against the manifest;
/// tensors are loaded onto the CPU. On any error nothing is returned.
pub fn read_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let manifest = read_manifest(dir)?;
    let manifest_path = dir.join(MANIFEST);
    let bad = |what: String| Error::Checkpoint(format!("{}: {what}", manifest_path.display()));
    if let Some(named) = dir.file_name().and_then(|n| n.to_str()).and_then(parse_dir_name) {
        if named != manifest.step {
            return Err(bad(format!(
                "says step {} but the directory is named for step {named}; the checkpoint was copied or renamed wrongly",
                manifest.step
            )));
        }
    }

    // Every file: present, of the listed length, with the listed checksum, a valid safetensors.
    let mut contents: BTreeMap<&str, (PathBuf, Vec<u8>)> = BTreeMap::new();
    for f in &manifest.files {
        check_file_name(dir, &f.file).map_err(|_| bad(format!("lists an invalid file name {:?}", f.file)))?;
        let path = dir.join(&f.file);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::Checkpoint(format!(
                    "{}: missing (the manifest lists it); the checkpoint is incomplete, restore from an older checkpoint or delete it",
                    path.display()
                )))
            }
            Err(e) => return Err(ckpt_io(&path, "cannot read", e)),
        };
        if bytes.len() as u64 != f.bytes {
            return Err(Error::Checkpoint(format!(
                "{}: length mismatch (manifest says {} bytes, file has {}); the file is torn, restore from an older checkpoint or delete it",
                path.display(),
                f.bytes,
                bytes.len()
            )));
        }
        let crc = crc32fast::hash(&bytes);
        if crc != f.crc32 {
            return Err(Error::Checkpoint(format!(
                "{}: checksum mismatch (manifest says crc32 {:#010x}, file has {crc:#010x}); the file is corrupt, restore from an older checkpoint or delete it",
                path.display(),
                f.crc32
            )));
        }
        if contents.insert(f.file.as_str(), (path, bytes)).is_some() {
            return Err(bad(format!("lists file {:?} twice", f.file)));
        }
    }
    let mut parsed: HashMap<&str, (&Path, SafeTensors<'_>, BTreeSet<String>)> = HashMap::new();
    for (name, (path, bytes)) in &contents {
        let st = SafeTensors::deserialize(bytes).map_err(|e| {
            Error::Checkpoint(format!(
                "{}: not a valid safetensors file ({e}); the file is corrupt, restore from an older checkpoint or delete it",
                path.display()
            ))
        })?;
        let names = st.names().into_iter().map(str::to_string).collect();
        parsed.insert(name, (path.as_path(), st, names));
    }

    // Every tensor: in its file, with the listed dtype, shape and checksum.
    let mut seen = BTreeSet::new();
    let mut tensors = Vec::with_capacity(manifest.tensors.len());
    for t in &manifest.tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(bad(format!("lists tensor {:?} twice", t.name)));
        }
        let Some((path, st, names)) = parsed.get_mut(t.file.as_str()) else {
            return Err(bad(format!("tensor {:?} is in file {:?}, which the manifest does not list", t.name, t.file)));
        };
        let at = || format!("{}: tensor {:?}", path.display(), t.name);
        let dtype: DType =
            t.dtype.parse().map_err(|_| bad(format!("tensor {:?} has unknown dtype {:?}", t.name, t.dtype)))?;
        let view = st
            .tensor(&t.name)
            .map_err(|_| Error::Checkpoint(format!("{}: missing from the file; the checkpoint is corrupt", at())))?;
        names.remove(&t.name);
        if view.dtype() != StDtype::from(dtype) || view.shape() != t.shape.as_slice() {
            return Err(Error::Checkpoint(format!(
                "{}: the file has dtype {} and shape {:?}, the manifest says {} and {:?}; the checkpoint is corrupt",
                at(),
                view.dtype(),
                view.shape(),
                t.dtype,
                t.shape
            )));
        }
        let crc = crc32fast::hash(view.data());
        if crc != t.crc32 {
            return Err(Error::Checkpoint(format!(
                "{}: checksum mismatch (manifest says crc32 {:#010x}, data has {crc:#010x}); the file is corrupt, restore from an older checkpoint or delete it",
                at(),
                t.crc32
            )));
        }
        if let Some(s) = t.shard {
            if s.count == 0 || s.index >= s.count {
                return Err(bad(format!("tensor {:?} has shard {} of {}, out of range", t.name, s.index, s.count)));
            }
        }
        let tensor = Tensor::from_raw_buffer(view.data(), dtype, &t.shape, &Device::Cpu)
            .map_err(|e| Error::Checkpoint(format!("{}: cannot build the tensor: {e}", at())))?;
        tensors.push(LoadedTensor { name: t.name.clone(), tensor, version: t.version, shard: t.shard });
    }
    for (path, _, names) in parsed.values() {
        if let Some(extra) = names.iter().next() {
            return Err(Error::Checkpoint(format!(
                "{}: holds tensor {extra:?}, which the manifest does not list; the checkpoint is corrupt",
                path.display()
            )));
        }
    }
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        step: manifest.step,
        created_unix_ms: manifest.created_unix_ms,
        metadata: manifest.metadata,
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_names_round_trip() {
        assert_eq!(checkpoint_dir_name(40), "ckpt-0000000040");
        assert_eq!(parse_dir_name("ckpt-0000000040"), Some(40));
        assert_eq!(parse_dir_name("ckpt-"), None);
        assert_eq!(parse_dir_name("ckpt-12a"), None);
        assert_eq!(parse_dir_name(".tmp-ckpt-0000000040-1-2-3"), None);
    }

    #[test]
    fn file_names_must_be_plain() {
        let dir = Path::new("/x");
        assert!(check_file_name(dir, "model.safetensors").is_ok());
        for bad in ["", "manifest.json", "../model.safetensors", "a/b.safetensors", ".hidden.safetensors", "x.bin"] {
            assert!(check_file_name(dir, bad).is_err(), "{bad:?}");
        }
    }
}

//! The edge between the protocol (`proto/strata/v1/ps.proto`, strata-proto's messages) and the
//! parameter server's semantics (strata-ps' types): every conversion between the two, and
//! [`status`], the one place where a [`strata_ps::Error`] becomes a `tonic::Status`.

use prost::bytes::Bytes;
use strata_proto::v1 as proto;
use strata_ps::{
    Chunk, CreateOutcome, ErrorKind, LrSchedule, PsMode, PsStatus, PullResult, PushHeader, PushOutcome, PushReply,
    ServerOptimizer, StaleRate, UpdateId, VariableInfo, WireFormat, MAX_CHUNK_ELEMENTS, MAX_VARIABLE_ELEMENTS,
};
use tonic::Status;

use crate::{Error, Result};

/// The gRPC status a parameter-server error answers with: its [`ErrorKind`]'s code and its
/// message. The client reads some of them back (`FAILED_PRECONDITION "stale push..."` is
/// [`Error::Stale`], `ABORTED` is retried).
pub(crate) fn status(e: strata_ps::Error) -> Status {
    let message = e.to_string();
    match e.kind() {
        ErrorKind::InvalidArgument => Status::invalid_argument(message),
        ErrorKind::FailedPrecondition => Status::failed_precondition(message),
        ErrorKind::NotFound => Status::not_found(message),
        ErrorKind::Aborted => Status::aborted(message),
        ErrorKind::DeadlineExceeded => Status::deadline_exceeded(message),
        ErrorKind::ResourceExhausted => Status::resource_exhausted(message),
        ErrorKind::Internal => Status::internal(message),
    }
}

/// A parameter-server error outside an RPC (a checkpoint to restore at start, a spec to read):
/// strata-core's checkpoint errors stay what they are, the others are configurations that
/// cannot be used.
impl From<strata_ps::Error> for Error {
    fn from(e: strata_ps::Error) -> Self {
        match e {
            strata_ps::Error::Checkpoint(e) => Error::Checkpoint(e),
            other => Error::Config(other.to_string()),
        }
    }
}

/// A value of the parameter server's configuration as the protocol carries it: an optimizer
/// ([`proto::OptimizerSpec`]), a learning-rate schedule ([`proto::LrScheduleSpec`]), a mode
/// ([`proto::ModeSpec`]) or a variable ([`proto::VariableSpec`]).
pub trait ProtoSpec: Sized {
    /// The protocol's message.
    type Spec;

    /// The value as the protocol carries it.
    fn to_spec(&self) -> Self::Spec;

    /// The value a spec describes, checked (as strata-ps' `validate` does, and the fields only
    /// the protocol has: names, dtypes, sizes); an unusable one is [`Error::Config`].
    fn from_spec(spec: &Self::Spec) -> Result<Self>;
}

impl ProtoSpec for ServerOptimizer {
    type Spec = proto::OptimizerSpec;

    fn to_spec(&self) -> proto::OptimizerSpec {
        let mut s = proto::OptimizerSpec { kind: self.name().into(), ..Default::default() };
        match *self {
            ServerOptimizer::Sgd { lr } => s.learning_rate = lr,
            ServerOptimizer::Momentum { lr, momentum, nesterov } => {
                s.learning_rate = lr;
                s.momentum = momentum;
                s.nesterov = nesterov;
            }
            ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
                s.learning_rate = lr;
                s.beta1 = beta1;
                s.beta2 = beta2;
                s.epsilon = eps;
                s.weight_decay = weight_decay;
            }
            ServerOptimizer::Adagrad { lr, initial_accumulator, eps } => {
                s.learning_rate = lr;
                s.initial_accumulator = initial_accumulator;
                s.epsilon = eps;
            }
        }
        s
    }

    fn from_spec(s: &proto::OptimizerSpec) -> Result<Self> {
        Ok(optimizer(s)?)
    }
}

impl ProtoSpec for LrSchedule {
    type Spec = proto::LrScheduleSpec;

    fn to_spec(&self) -> proto::LrScheduleSpec {
        let kind = strata_ps::schedule_kind(self).into();
        match *self {
            LrSchedule::Constant { lr } => proto::LrScheduleSpec { kind, lr, ..Default::default() },
            LrSchedule::WarmupCosine { peak, warmup_steps, total_steps, final_lr }
            | LrSchedule::WarmupLinear { peak, warmup_steps, total_steps, final_lr } => {
                proto::LrScheduleSpec { kind, peak, warmup_steps, total_steps, final_lr, ..Default::default() }
            }
        }
    }

    fn from_spec(s: &proto::LrScheduleSpec) -> Result<Self> {
        Ok(schedule(s)?)
    }
}

impl ProtoSpec for PsMode {
    type Spec = proto::ModeSpec;

    fn to_spec(&self) -> proto::ModeSpec {
        match *self {
            PsMode::Async => proto::ModeSpec { mode: "async".into(), ..Default::default() },
            PsMode::Sync { workers, backup_workers } => {
                proto::ModeSpec { mode: "sync".into(), workers, backup_workers, ..Default::default() }
            }
            PsMode::Stale { staleness } => proto::ModeSpec { mode: "stale".into(), staleness, ..Default::default() },
        }
    }

    fn from_spec(s: &proto::ModeSpec) -> Result<Self> {
        Ok(mode(s)?)
    }
}

impl ProtoSpec for VariableInfo {
    type Spec = proto::VariableSpec;

    fn to_spec(&self) -> proto::VariableSpec {
        proto::VariableSpec {
            name: self.name.clone(),
            shape: self.shape.iter().map(|&d| d as u64).collect(),
            dtype: "f32".into(),
            variable: self.variable.clone(),
            part: self.part,
            num_parts: self.num_parts,
            row_offset: self.row_offset,
            full_shape: self.full_shape.iter().map(|&d| d as u64).collect(),
            state: self.state,
        }
    }

    fn from_spec(s: &proto::VariableSpec) -> Result<Self> {
        Ok(variable(s)?)
    }
}

impl ProtoSpec for strata_ps::TableInfo {
    type Spec = proto::TableSpec;

    fn to_spec(&self) -> proto::TableSpec {
        super::tables::table_spec(self)
    }

    fn from_spec(s: &proto::TableSpec) -> Result<Self> {
        Ok(super::tables::table_info(s)?)
    }
}

/// The optimizer a spec names, checked. Every number of the spec must be finite, also those
/// the named optimizer does not use.
fn optimizer(s: &proto::OptimizerSpec) -> strata_ps::Result<ServerOptimizer> {
    strata_ps::check_name("optimizer", &s.kind)?;
    let lr = s.learning_rate;
    let numbers = [s.learning_rate, s.momentum, s.beta1, s.beta2, s.epsilon, s.weight_decay, s.initial_accumulator];
    if numbers.iter().any(|v| !v.is_finite()) {
        return Err(strata_ps::Error::NonFiniteOptimizer { kind: s.kind.clone() });
    }
    if lr <= 0.0 {
        return Err(strata_ps::Error::LearningRate { lr });
    }
    let opt = match s.kind.as_str() {
        "sgd" => ServerOptimizer::Sgd { lr },
        "momentum" => ServerOptimizer::Momentum { lr, momentum: s.momentum, nesterov: s.nesterov },
        "adamw" => {
            ServerOptimizer::AdamW { lr, beta1: s.beta1, beta2: s.beta2, eps: s.epsilon, weight_decay: s.weight_decay }
        }
        "adagrad" => ServerOptimizer::Adagrad { lr, initial_accumulator: s.initial_accumulator, eps: s.epsilon },
        other => return Err(strata_ps::Error::UnknownOptimizer { kind: other.into() }),
    };
    opt.validate()?;
    Ok(opt)
}

/// The learning-rate schedule a spec names, checked as a task checks it
/// ([`strata_ps::check_schedule`]). Every number of the spec must be finite, also those the
/// named kind does not use; each refusal names the field.
fn schedule(s: &proto::LrScheduleSpec) -> strata_ps::Result<LrSchedule> {
    strata_ps::check_name("schedule", &s.kind)?;
    let (warmup_steps, total_steps) = (s.warmup_steps, s.total_steps);
    let schedule = match s.kind.as_str() {
        "constant" => LrSchedule::Constant { lr: s.lr },
        "warmup_cosine" => LrSchedule::WarmupCosine { peak: s.peak, warmup_steps, total_steps, final_lr: s.final_lr },
        "warmup_linear" => LrSchedule::WarmupLinear { peak: s.peak, warmup_steps, total_steps, final_lr: s.final_lr },
        other => return Err(strata_ps::Error::UnknownSchedule { kind: other.into() }),
    };
    for (field, value) in [("lr", s.lr), ("peak", s.peak), ("final_lr", s.final_lr)] {
        if !value.is_finite() {
            return Err(strata_ps::Error::InvalidSchedule {
                kind: strata_ps::schedule_kind(&schedule),
                field,
                detail: format!("{value}: every rate of the schedule must be a finite number"),
            });
        }
    }
    strata_ps::check_schedule(&schedule)?;
    Ok(schedule)
}

/// The mode a spec names (`""` is async), checked.
fn mode(s: &proto::ModeSpec) -> strata_ps::Result<PsMode> {
    strata_ps::check_name("mode", &s.mode)?;
    let mode = match s.mode.as_str() {
        "async" | "" => PsMode::Async,
        "sync" => PsMode::Sync { workers: s.workers, backup_workers: s.backup_workers },
        "stale" => PsMode::Stale { staleness: s.staleness },
        other => return Err(strata_ps::Error::UnknownMode { mode: other.into() }),
    };
    mode.validate()?;
    Ok(mode)
}

/// The rate of stale pushes a spec names (empty: constant).
fn stale_rate(name: &str) -> strata_ps::Result<StaleRate> {
    strata_ps::check_name("stale_rate", name)?;
    match name {
        "constant" | "" => Ok(StaleRate::Constant),
        "inverse" => Ok(StaleRate::Inverse),
        other => Err(strata_ps::Error::UnknownStaleRate { rate: other.into() }),
    }
}

/// The variable a spec describes (an empty `variable` is the shard's name, an empty
/// `full_shape` its shape, `num_parts` 0 is 1), checked: a name, dtype f32, sizes.
fn variable(s: &proto::VariableSpec) -> strata_ps::Result<VariableInfo> {
    if s.name.is_empty() {
        return Err(strata_ps::Error::UnnamedVariable);
    }
    strata_ps::check_name("variable", &s.name)?;
    strata_ps::check_name("variable", &s.variable)?;
    strata_ps::check_name("dtype", &s.dtype)?;
    if s.shape.len() > strata_ps::limits::MAX_RANK || s.full_shape.len() > strata_ps::limits::MAX_RANK {
        return Err(strata_ps::Error::RankTooLarge {
            variable: s.name.clone(),
            rank: s.shape.len().max(s.full_shape.len()),
        });
    }
    if s.dtype != "f32" {
        return Err(strata_ps::Error::UnsupportedDtype { variable: s.name.clone(), dtype: s.dtype.clone() });
    }
    let dims = |d: &[u64]| -> strata_ps::Result<Vec<usize>> {
        d.iter()
            .map(|&x| usize::try_from(x).ok().filter(|&x| x <= MAX_VARIABLE_ELEMENTS))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| strata_ps::Error::VariableTooLarge { variable: s.name.clone(), shape: d.to_vec() })
    };
    let shape = dims(&s.shape)?;
    let full_shape = if s.full_shape.is_empty() { shape.clone() } else { dims(&s.full_shape)? };
    let info = VariableInfo {
        name: s.name.clone(),
        shape,
        variable: if s.variable.is_empty() { s.name.clone() } else { s.variable.clone() },
        part: s.part,
        num_parts: s.num_parts.max(1),
        row_offset: s.row_offset,
        full_shape,
        state: s.state,
    };
    info.validate()?;
    Ok(info)
}

/// The wire format a message's `wire_format` field names (0, or absent, is f32); an unknown
/// value is refused.
pub(crate) fn wire_format(value: i32) -> strata_ps::Result<WireFormat> {
    match proto::WireFormat::try_from(value) {
        Ok(proto::WireFormat::F32) => Ok(WireFormat::F32),
        Ok(proto::WireFormat::F16) => Ok(WireFormat::F16),
        Ok(proto::WireFormat::Bf16) => Ok(WireFormat::Bf16),
        Err(_) => Err(strata_ps::Error::UnknownWireFormat { value }),
    }
}

/// The protocol's value of a wire format.
pub(crate) fn wire_format_spec(format: WireFormat) -> i32 {
    let f = match format {
        WireFormat::F32 => proto::WireFormat::F32,
        WireFormat::F16 => proto::WireFormat::F16,
        WireFormat::Bf16 => proto::WireFormat::Bf16,
    };
    f as i32
}

/// A `CreateVariables` header, checked (a missing optimizer is refused, a missing mode is
/// async, a missing schedule is the optimizer's constant rate).
pub(crate) fn create_header(h: &proto::CreateHeader) -> strata_ps::Result<strata_ps::CreateHeader> {
    let variables = h.variables.iter().map(variable).collect::<strata_ps::Result<Vec<_>>>()?;
    Ok(strata_ps::CreateHeader {
        variables,
        optimizer: optimizer(&h.optimizer.clone().unwrap_or_default())?,
        schedule: h.optimizer.as_ref().and_then(|o| o.schedule.as_ref()).map(schedule).transpose()?,
        stale_rate: stale_rate(h.optimizer.as_ref().map_or("", |o| o.stale_rate.as_str()))?,
        mode: mode(&h.mode.clone().unwrap_or_default())?,
        wire_format: wire_format(h.wire_format)?,
        tables: h.tables.iter().map(super::tables::table_info).collect::<strata_ps::Result<_>>()?,
    })
}

/// The bytes of values a checked create header's chunks may carry: its variables' elements
/// times 4, refused over the task's limit ([`strata_ps::limits::MAX_TASK_BYTES`]).
pub(crate) fn declared_bytes(h: &strata_ps::CreateHeader) -> strata_ps::Result<usize> {
    let bytes = h.variables.iter().map(|v| v.numel() as u64 * 4).fold(0u64, u64::saturating_add);
    if bytes > strata_ps::limits::MAX_TASK_BYTES {
        return Err(strata_ps::Error::TaskTooLarge { task: "this task".into(), bytes });
    }
    Ok(usize::try_from(bytes).unwrap_or(usize::MAX))
}

/// The protocol's optimizer spec of `optimizer` following `schedule`, at `stale_rate`.
fn optimizer_spec(
    optimizer: &ServerOptimizer,
    schedule: Option<&LrSchedule>,
    stale_rate: StaleRate,
) -> proto::OptimizerSpec {
    let stale_rate = match stale_rate {
        StaleRate::Constant => String::new(),
        rate => rate.name().into(),
    };
    proto::OptimizerSpec { schedule: schedule.map(ProtoSpec::to_spec), stale_rate, ..optimizer.to_spec() }
}

/// The protocol's create header of variables, an optimizer, its schedule and rate of stale
/// pushes, a mode and the job's wire format.
pub(crate) fn create_header_spec<'a>(
    vars: impl IntoIterator<Item = &'a VariableInfo>,
    optimizer: &ServerOptimizer,
    schedule: Option<&LrSchedule>,
    stale_rate: StaleRate,
    mode: PsMode,
    format: WireFormat,
) -> proto::CreateHeader {
    proto::CreateHeader {
        variables: vars.into_iter().map(ProtoSpec::to_spec).collect(),
        optimizer: Some(optimizer_spec(optimizer, schedule, stale_rate)),
        mode: Some(mode.to_spec()),
        wire_format: wire_format_spec(format),
        tables: Vec::new(),
    }
}

/// The answer to `CreateVariables`.
pub(crate) fn create_response(o: CreateOutcome) -> proto::CreateVariablesResponse {
    proto::CreateVariablesResponse { versions: o.versions, existed: o.existed, version: o.version }
}

/// What a `CreateVariables` answer says.
pub(crate) fn create_outcome(r: proto::CreateVariablesResponse) -> CreateOutcome {
    CreateOutcome { versions: r.versions, existed: r.existed, version: r.version }
}

/// A received chunk of `format` (its length checked) whose data is one piece of f32: a 16-bit
/// chunk is decoded, exactly.
pub(crate) fn chunk(c: proto::TensorChunk, format: WireFormat) -> strata_ps::Result<Chunk> {
    strata_ps::check_chunk_len_in(c.data.len(), format)?;
    let data = match format.half() {
        None => c.data,
        Some(half) => strata_ps::decode_half(&c.data, half),
    };
    Ok(Chunk { var: c.variable, offset: c.offset, pieces: vec![data] })
}

/// Chunks of at most [`MAX_CHUNK_ELEMENTS`] of one variable's values (copied).
pub(crate) fn chunks_of(var: u32, values: &[f32]) -> impl Iterator<Item = proto::TensorChunk> + '_ {
    values.chunks(MAX_CHUNK_ELEMENTS).enumerate().map(move |(i, c)| proto::TensorChunk {
        variable: var,
        offset: (i * MAX_CHUNK_ELEMENTS) as u64,
        data: Bytes::copy_from_slice(bytemuck::cast_slice(c)),
    })
}

/// A `Push` header as strata-ps takes it, and the wire format of its chunks (an unknown one
/// is refused).
pub(crate) fn push_header(h: proto::PushHeader) -> strata_ps::Result<(PushHeader, WireFormat)> {
    let format = wire_format(h.wire_format)?;
    let header = PushHeader {
        id: UpdateId { worker: h.worker, client: h.client, step: h.step, seq: h.seq },
        base_version: h.base_version,
        variables: h.variables,
        rows: super::tables::rows(h.rows),
    };
    Ok((header, format))
}

/// The protocol's `Push` header of update `id`, computed from `base_version`, of `names`, whose
/// chunks are in `format`.
pub(crate) fn push_header_spec(
    id: &UpdateId,
    base_version: u64,
    names: &[&str],
    format: WireFormat,
) -> proto::PushHeader {
    proto::PushHeader {
        worker: id.worker.clone(),
        client: id.client.clone(),
        step: id.step,
        seq: id.seq,
        base_version,
        variables: names.iter().map(|n| n.to_string()).collect(),
        wire_format: wire_format_spec(format),
        rows: Vec::new(),
    }
}

/// The answer to a `Push`.
pub(crate) fn push_response(r: PushReply) -> proto::PushResponse {
    match r {
        PushReply::Applied { version, duplicate } => {
            proto::PushResponse { applied: true, duplicate, dropped: false, version }
        }
        PushReply::Dropped { version, duplicate } => {
            proto::PushResponse { applied: false, duplicate, dropped: true, version }
        }
    }
}

/// What a `Push` answer says.
pub(crate) fn push_outcome(r: &proto::PushResponse) -> PushOutcome {
    if r.dropped {
        PushOutcome::Dropped { version: r.version }
    } else {
        PushOutcome::Applied { version: r.version, duplicate: r.duplicate }
    }
}

/// The header of a `Pull` answer in `format`, and its chunks as (variable, offset, data): the
/// variables' own memory for f32; for a 16-bit format each chunk is encoded (rounded to
/// nearest even) when the iterator reaches it, so one chunk's copy exists at a time.
pub(crate) fn pull_parts(
    p: PullResult,
    format: WireFormat,
) -> (proto::PullHeader, impl Iterator<Item = (u32, u64, Bytes)> + Send + 'static) {
    let header = proto::PullHeader {
        version: p.version,
        variables: p.variables.iter().map(|(info, _)| info.to_spec()).collect(),
        variable_versions: p.variables.iter().map(|(_, v)| *v).collect(),
        wire_format: wire_format_spec(format),
        push: None,
    };
    let half = format.half();
    let chunks = p.chunks.into_iter().map(move |c| {
        let data = match half {
            None => c.data,
            Some(h) => strata_ps::encode_half_bytes(&c.data, h),
        };
        (c.var, c.offset, data)
    });
    (header, chunks)
}

/// The answer to `Status`.
pub(crate) fn status_response(s: PsStatus) -> proto::PsStatusResponse {
    proto::PsStatusResponse {
        task: s.task,
        version: s.version,
        variables: s.variables.iter().map(|(info, _)| info.to_spec()).collect(),
        variable_versions: s.variables.iter().map(|(_, v)| *v).collect(),
        pushes_applied: s.pushes_applied,
        pushes_duplicate: s.pushes_duplicate,
        pushes_dropped: s.pushes_dropped,
        pushes_stale: s.pushes_stale,
        restored_step: s.restored_step,
        restored_version: s.restored_version,
        mode: Some(s.mode.to_spec()),
        optimizer: s.optimizer.as_ref().map(|o| optimizer_spec(o, s.schedule.as_ref(), s.stale_rate)),
        rounds: s.rounds,
        applied_by_worker: s.applied_by_worker.into_iter().collect(),
        pushes_streamed: s.pushes_streamed,
        pushes_aborted: s.pushes_aborted,
        streaming: s.streaming,
        wire_format: wire_format_spec(s.wire_format),
        tables: s.tables.iter().map(super::tables::table_status_spec).collect(),
    }
}

/// What a `Status` answer says (a variable without a version is at version 0).
pub(crate) fn ps_status(r: proto::PsStatusResponse) -> strata_ps::Result<PsStatus> {
    let variables = r.variables.iter().map(variable).collect::<strata_ps::Result<Vec<_>>>()?;
    let versions = r.variable_versions.iter().copied().chain(std::iter::repeat(0));
    Ok(PsStatus {
        task: r.task,
        version: r.version,
        variables: variables.into_iter().zip(versions).collect(),
        pushes_applied: r.pushes_applied,
        pushes_duplicate: r.pushes_duplicate,
        pushes_dropped: r.pushes_dropped,
        pushes_stale: r.pushes_stale,
        pushes_streamed: r.pushes_streamed,
        pushes_aborted: r.pushes_aborted,
        streaming: r.streaming,
        restored_step: r.restored_step,
        restored_version: r.restored_version,
        mode: mode(&r.mode.unwrap_or_default())?,
        optimizer: r.optimizer.as_ref().map(optimizer).transpose()?,
        schedule: r.optimizer.as_ref().and_then(|o| o.schedule.as_ref()).map(schedule).transpose()?,
        stale_rate: stale_rate(r.optimizer.as_ref().map_or("", |o| o.stale_rate.as_str()))?,
        rounds: r.rounds,
        applied_by_worker: r.applied_by_worker.into_iter().collect(),
        wire_format: wire_format(r.wire_format)?,
        tables: r.tables.iter().map(super::tables::table_status).collect::<strata_ps::Result<_>>()?,
    })
}

/// The variables a `Pull` answer's header describes, checked.
pub(crate) fn pulled_variables(h: &proto::PullHeader) -> strata_ps::Result<Vec<VariableInfo>> {
    h.variables.iter().map(variable).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_code() {
        let cases = [
            (strata_ps::Error::ChunkNotWholeElements { bytes: 6 }, tonic::Code::InvalidArgument),
            (strata_ps::Error::NoVariables { task: "ps:0".into() }, tonic::Code::FailedPrecondition),
            (strata_ps::Error::Stale { base: 1, version: 4, bound: 2 }, tonic::Code::FailedPrecondition),
            (
                strata_ps::Error::UnknownVariable { task: "ps:0".into(), variable: "x".into(), held: 1 },
                tonic::Code::NotFound,
            ),
            (strata_ps::Error::Overtaken { task: "ps:0".into() }, tonic::Code::Aborted),
            (
                strata_ps::Error::VersionTimeout {
                    task: "ps:0".into(),
                    version: 3,
                    waited: std::time::Duration::from_secs(1),
                },
                tonic::Code::DeadlineExceeded,
            ),
            (strata_ps::Error::RoundUnrecorded { task: "ps:0".into(), base: 2 }, tonic::Code::Internal),
        ];
        for (e, code) in cases {
            let message = e.to_string();
            let s = status(e);
            assert_eq!((s.code(), s.message()), (code, message.as_str()));
        }
    }

    #[test]
    fn wire_formats_round_trip_and_unknown_ones_are_refused() {
        for f in [WireFormat::F32, WireFormat::F16, WireFormat::Bf16] {
            assert_eq!(wire_format(wire_format_spec(f)).unwrap(), f);
        }
        for value in [3, -1, i32::MAX] {
            let st = status(wire_format(value).unwrap_err());
            assert_eq!(st.code(), tonic::Code::InvalidArgument);
            assert_eq!(
                st.message(),
                format!("unknown wire format {value}; a parameter server takes 0 (f32), 1 (f16) or 2 (bf16)")
            );
        }
        let h = proto::PushHeader { wire_format: 9, ..Default::default() };
        assert!(matches!(push_header(h), Err(strata_ps::Error::UnknownWireFormat { value: 9 })));
        // A chunk of the generated path: decoded exactly, its length checked in elements.
        let c = proto::TensorChunk { variable: 0, offset: 0, data: Bytes::from_static(&[0x80, 0x3f, 0x00, 0xc0]) };
        let got = chunk(c.clone(), WireFormat::Bf16).unwrap();
        assert_eq!(&got.pieces[0][..], bytemuck::cast_slice::<f32, u8>(&[1.0, -2.0]));
        let odd = proto::TensorChunk { data: Bytes::from_static(&[0, 0, 0]), ..c };
        let e = chunk(odd, WireFormat::F16).unwrap_err();
        assert_eq!(e.to_string(), "a chunk carries 3 bytes, not a whole number of f16 elements (2 bytes each)");
    }

    #[test]
    fn specs_are_checked_as_before() {
        let mut s = ServerOptimizer::Sgd { lr: 0.5 }.to_spec();
        s.momentum = f64::NAN;
        let e = ServerOptimizer::from_spec(&s).unwrap_err();
        assert!(e.to_string().contains("the sgd optimizer's parameters must be finite numbers"), "{e}");
        let v = proto::VariableSpec {
            name: "x".into(),
            shape: vec![1 << 31, 2],
            dtype: "f32".into(),
            ..Default::default()
        };
        let e = VariableInfo::from_spec(&v).unwrap_err();
        assert!(e.to_string().contains("more than 2147483648 elements; partition it"), "{e}");
        let v = proto::VariableSpec { name: "x".into(), shape: vec![3], dtype: "f32".into(), ..Default::default() };
        assert_eq!(VariableInfo::from_spec(&v).unwrap(), VariableInfo::whole("x", vec![3]));
    }

    /// Schedules travel exactly, and a bad one is `INVALID_ARGUMENT` naming the field.
    #[test]
    fn schedules_round_trip_and_bad_ones_are_refused_naming_the_field() {
        for s in [
            LrSchedule::Constant { lr: 0.25 },
            LrSchedule::WarmupCosine { peak: 3e-3, warmup_steps: 60, total_steps: 1200, final_lr: 3e-3 / 10.0 },
            LrSchedule::WarmupLinear { peak: 1.0, warmup_steps: 0, total_steps: 1, final_lr: 0.0 },
        ] {
            assert_eq!(LrSchedule::from_spec(&s.to_spec()).unwrap(), s);
        }
        let cases = [
            (
                proto::LrScheduleSpec { kind: "warmup_cosine".into(), peak: 0.1, warmup_steps: 9, total_steps: 9, ..Default::default() },
                "warmup_cosine learning-rate schedule: total_steps 9 with warmup_steps 9: the decay must end after the warm-up; use more total_steps than warmup_steps",
            ),
            (
                proto::LrScheduleSpec { kind: "constant".into(), lr: 0.1, peak: f64::INFINITY, ..Default::default() },
                "constant learning-rate schedule: peak inf: every rate of the schedule must be a finite number",
            ),
            (
                proto::LrScheduleSpec { kind: "exponential".into(), ..Default::default() },
                "unknown learning-rate schedule \"exponential\"; a parameter server follows constant, warmup_cosine or warmup_linear",
            ),
        ];
        for (spec, message) in cases {
            let e = schedule(&spec).unwrap_err();
            let st = status(e);
            assert_eq!((st.code(), st.message()), (tonic::Code::InvalidArgument, message));
        }
        // Inside a create header, and absent: the constant rate.
        let sgd = ServerOptimizer::Sgd { lr: 0.5 };
        let mut h = create_header_spec([], &sgd, None, StaleRate::Constant, PsMode::Async, WireFormat::F32);
        assert_eq!(create_header(&h).unwrap().schedule, None);
        let s = LrSchedule::WarmupLinear { peak: 1.0, warmup_steps: 2, total_steps: 5, final_lr: 0.5 };
        h = create_header_spec([], &sgd, Some(&s), StaleRate::Constant, PsMode::Async, WireFormat::F32);
        assert_eq!(create_header(&h).unwrap().schedule, Some(s));
    }

    #[test]
    fn stale_rates_round_trip_and_an_unknown_one_is_refused_naming_the_field() {
        let sgd = ServerOptimizer::Sgd { lr: 0.5 };
        for rate in [StaleRate::Constant, StaleRate::Inverse] {
            let h = create_header_spec([], &sgd, None, rate, PsMode::Async, WireFormat::F32);
            assert_eq!(create_header(&h).unwrap().stale_rate, rate);
        }
        // The constant rate travels as the field's default: an older task reads it.
        let h = create_header_spec([], &sgd, None, StaleRate::Constant, PsMode::Async, WireFormat::F32);
        assert_eq!(h.optimizer.as_ref().unwrap().stale_rate, "");
        let mut h = create_header_spec([], &sgd, None, StaleRate::Inverse, PsMode::Async, WireFormat::F32);
        h.optimizer.as_mut().unwrap().stale_rate = "linear".into();
        let st = status(create_header(&h).unwrap_err());
        assert_eq!(
            (st.code(), st.message()),
            (tonic::Code::InvalidArgument, "unknown stale_rate \"linear\"; use constant or inverse")
        );
    }
}

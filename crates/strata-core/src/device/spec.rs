//! Device names in TensorFlow's form: [`DeviceType`] and [`DeviceSpec`].

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// The full form a device spec may take, quoted in parse errors.
const EXPECTED: &str = "expected /job:<name>/replica:<n>/task:<n>/device:<CPU|GPU>:<n|*> \
     (any subset of the components, in that order) or a short form such as /gpu:0 or CPU:0";

/// The kind of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceType {
    /// The host CPU.
    Cpu,
    /// A GPU.
    Gpu,
}

impl DeviceType {
    /// Both types, CPU first (the order devices are listed in).
    pub const ALL: [DeviceType; 2] = [DeviceType::Cpu, DeviceType::Gpu];

    /// The upper-case name, `"CPU"` or `"GPU"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceType::Cpu => "CPU",
            DeviceType::Gpu => "GPU",
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeviceType {
    type Err = Error;

    /// Parses `CPU` or `GPU`, in any case.
    fn from_str(s: &str) -> Result<Self> {
        if s.eq_ignore_ascii_case("cpu") {
            Ok(DeviceType::Cpu)
        } else if s.eq_ignore_ascii_case("gpu") {
            Ok(DeviceType::Gpu)
        } else {
            Err(Error::InvalidDeviceSpec {
                spec: s.to_string(),
                reason: "unknown device type; expected CPU or GPU".to_string(),
            })
        }
    }
}

impl serde::Serialize for DeviceType {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for DeviceType {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A (possibly partial) device name, as TensorFlow writes them:
/// `/job:worker/replica:0/task:1/device:GPU:0`.
///
/// Every component is optional; a missing component means "any". Parsing accepts:
///
/// * any subset of `/job:<name>`, `/replica:<n>`, `/task:<n>`, `/device:<type>:<n>` in that
///   order (`/job:ps/task:0`, `/device:CPU:0`);
/// * `<type>` is `CPU` or `GPU` in any case, or `*` (any type); `<n>` of the device is a
///   non-negative integer or `*` (any index) and may be left out (`/device:GPU`);
/// * the short device forms `/gpu:1`, `/cpu:0`, `GPU:0`, `gpu:*` (the leading `/` is optional,
///   as is the one before `job:`);
/// * `/` alone, the spec with no component (it matches every device);
/// * keys (`job`, `replica`, `task`, `device`) in any case; surrounding whitespace is ignored.
///
/// Job names start with a letter and contain letters, digits, `_` and `-`.
///
/// [`Display`](fmt::Display) prints the canonical long form of the components present
/// (`GPU:0` prints as `/device:GPU:0`, a device without index as `/device:GPU:*`), so that
/// `spec.to_string().parse() == spec` for every parsed spec. Serde uses the same string form.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceSpec {
    /// The job name (`worker`, `ps`, `chief`).
    pub job: Option<String>,
    /// The replica within the job.
    pub replica: Option<u32>,
    /// The task within the job.
    pub task: Option<u32>,
    /// The device type.
    pub device_type: Option<DeviceType>,
    /// The device index within its type; `None` is TensorFlow's `*`.
    pub device_index: Option<u32>,
}

impl DeviceSpec {
    /// `/device:CPU:<index>`.
    pub fn cpu(index: u32) -> Self {
        DeviceSpec { device_type: Some(DeviceType::Cpu), device_index: Some(index), ..Self::default() }
    }

    /// `/device:GPU:<index>`.
    pub fn gpu(index: u32) -> Self {
        DeviceSpec { device_type: Some(DeviceType::Gpu), device_index: Some(index), ..Self::default() }
    }

    /// `/device:<device_type>:<index>`.
    pub fn device(device_type: DeviceType, index: u32) -> Self {
        DeviceSpec { device_type: Some(device_type), device_index: Some(index), ..Self::default() }
    }

    /// This spec with the job set.
    pub fn with_job(mut self, job: impl Into<String>) -> Self {
        self.job = Some(job.into());
        self
    }

    /// This spec with the replica set.
    pub fn with_replica(mut self, replica: u32) -> Self {
        self.replica = Some(replica);
        self
    }

    /// This spec with the task set.
    pub fn with_task(mut self, task: u32) -> Self {
        self.task = Some(task);
        self
    }

    /// Whether the device type is CPU.
    pub fn is_cpu(&self) -> bool {
        self.device_type == Some(DeviceType::Cpu)
    }

    /// Whether the device type is GPU.
    pub fn is_gpu(&self) -> bool {
        self.device_type == Some(DeviceType::Gpu)
    }

    /// Whether no component is set (the spec `/`, which matches every device).
    pub fn is_empty(&self) -> bool {
        *self == DeviceSpec::default()
    }

    /// Fills the components missing here with those of `other`; components already set are
    /// kept. (TensorFlow's `make_merged_spec` lets `other` win instead; call
    /// `other.clone().merge_from(self)` for that.)
    ///
    /// The device index is only taken from `other` when the device types agree (or ours is
    /// unset): merging `/device:CPU:*` with `/device:GPU:1` gives `/device:CPU:*`.
    pub fn merge_from(&mut self, other: &DeviceSpec) {
        if self.job.is_none() {
            self.job.clone_from(&other.job);
        }
        if self.replica.is_none() {
            self.replica = other.replica;
        }
        if self.task.is_none() {
            self.task = other.task;
        }
        let same_type = self.device_type.is_none() || self.device_type == other.device_type;
        if self.device_type.is_none() {
            self.device_type = other.device_type;
        }
        if self.device_index.is_none() && same_type {
            self.device_index = other.device_index;
        }
    }

    /// A copy of this spec merged with `other` (see [`DeviceSpec::merge_from`]).
    pub fn merged(&self, other: &DeviceSpec) -> DeviceSpec {
        let mut merged = self.clone();
        merged.merge_from(other);
        merged
    }

    /// Whether every component set in `other` equals ours (`other` is a pattern; its unset
    /// components match anything). `/job:w/device:GPU:0` matches `/device:GPU:0` and `/job:w`;
    /// `/device:GPU:*` does not match `/device:GPU:0` (our index is unset).
    pub fn matches(&self, other: &DeviceSpec) -> bool {
        fn ok<T: PartialEq>(ours: &Option<T>, theirs: &Option<T>) -> bool {
            theirs.is_none() || ours == theirs
        }
        ok(&self.job, &other.job)
            && ok(&self.replica, &other.replica)
            && ok(&self.task, &other.task)
            && ok(&self.device_type, &other.device_type)
            && ok(&self.device_index, &other.device_index)
    }

    /// Only the device part (`/device:GPU:0` of `/job:w/task:0/device:GPU:0`).
    pub fn device_part(&self) -> DeviceSpec {
        DeviceSpec { device_type: self.device_type, device_index: self.device_index, ..Self::default() }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("/");
        }
        if let Some(job) = &self.job {
            write!(f, "/job:{job}")?;
        }
        if let Some(replica) = self.replica {
            write!(f, "/replica:{replica}")?;
        }
        if let Some(task) = self.task {
            write!(f, "/task:{task}")?;
        }
        match (self.device_type, self.device_index) {
            (Some(t), Some(i)) => write!(f, "/device:{t}:{i}"),
            (Some(t), None) => write!(f, "/device:{t}:*"),
            (None, Some(i)) => write!(f, "/device:*:{i}"),
            (None, None) => Ok(()),
        }
    }
}

/// The components, in the order they must appear.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Component {
    Job,
    Replica,
    Task,
    Device,
}

impl Component {
    fn name(self) -> &'static str {
        match self {
            Component::Job => "job",
            Component::Replica => "replica",
            Component::Task => "task",
            Component::Device => "device",
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        parse_spec(s).map_err(|reason| Error::InvalidDeviceSpec { spec: s.to_string(), reason })
    }
}

/// Parses a spec; the error is the reason only (the caller adds the input).
fn parse_spec(s: &str) -> std::result::Result<DeviceSpec, String> {
    let text = s.trim();
    if text.is_empty() {
        return Err(format!("the device spec is empty; {EXPECTED}"));
    }
    if text == "/" {
        return Ok(DeviceSpec::default());
    }
    let body = text.strip_prefix('/').unwrap_or(text);
    let mut spec = DeviceSpec::default();
    let mut last: Option<Component> = None;
    let mut seen: Vec<Component> = Vec::with_capacity(4);
    for part in body.split('/') {
        if part.is_empty() {
            return Err(format!("empty component (a doubled or trailing '/'); {EXPECTED}"));
        }
        let Some((key, value)) = part.split_once(':') else {
            return Err(format!("unknown component {part:?}; {EXPECTED}"));
        };
        let lower = key.to_ascii_lowercase();
        let component = match lower.as_str() {
            "job" => Component::Job,
            "replica" => Component::Replica,
            "task" => Component::Task,
            "device" | "cpu" | "gpu" => Component::Device,
            _ => return Err(format!("unknown component {part:?}; {EXPECTED}")),
        };
        if seen.contains(&component) {
            return Err(format!(
                "duplicated {} component {part:?}; give each component at most once",
                component.name()
            ));
        }
        if let Some(prev) = last {
            if prev > component {
                return Err(format!("component {part:?} comes after the {} component; {EXPECTED}", prev.name()));
            }
        }
        seen.push(component);
        last = Some(component);
        match component {
            Component::Job => spec.job = Some(parse_job(value)?),
            Component::Replica => spec.replica = Some(parse_number(value, "replica", "replica:<n>")?),
            Component::Task => spec.task = Some(parse_number(value, "task", "task:<n>")?),
            Component::Device => {
                let (type_str, index_str) = if lower == "device" {
                    match value.split_once(':') {
                        Some((t, i)) => (t, Some(i)),
                        None => (value, None),
                    }
                } else {
                    (key, Some(value))
                };
                spec.device_type = parse_type(type_str)?;
                spec.device_index = match index_str {
                    None | Some("*") => None,
                    Some(i) => Some(parse_number(i, "device index", "device:<CPU|GPU>:<n|*>")?),
                };
            }
        }
    }
    Ok(spec)
}

fn parse_job(value: &str) -> std::result::Result<String, String> {
    let mut chars = value.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if valid {
        Ok(value.to_string())
    } else {
        Err(format!(
            "bad job name {value:?}; expected job:<name> with a name that starts with a letter \
             and holds only letters, digits, '_' and '-'"
        ))
    }
}

fn parse_type(value: &str) -> std::result::Result<Option<DeviceType>, String> {
    match value {
        "*" => Ok(None),
        "" => Err("missing device type; expected device:<CPU|GPU>:<n|*>".to_string()),
        _ => value
            .parse()
            .map(Some)
            .map_err(|_| format!("unknown device type {value:?}; expected CPU or GPU, as in device:GPU:0")),
    }
}

fn parse_number(value: &str, what: &str, form: &str) -> std::result::Result<u32, String> {
    if value.is_empty() {
        return Err(format!("missing {what}; expected {form}"));
    }
    if let Some(digits) = value.strip_prefix('-') {
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("negative {what} {value}; indices start at 0 (expected {form})"));
        }
    }
    if !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("bad {what} {value:?}; expected {form} with a non-negative integer"));
    }
    value.parse().map_err(|_| format!("{what} {value} is too large; expected {form} below 2^32"))
}

impl serde::Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> DeviceSpec {
        s.parse().unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
    }

    fn parse_err(s: &str) -> String {
        match s.parse::<DeviceSpec>() {
            Ok(spec) => panic!("{s:?} should not parse, got {spec:?}"),
            Err(e) => {
                assert!(matches!(e, Error::InvalidDeviceSpec { .. }), "{e:?}");
                e.to_string()
            }
        }
    }

    #[test]
    fn device_type_display_and_parse() {
        assert_eq!(DeviceType::Cpu.to_string(), "CPU");
        assert_eq!(DeviceType::Gpu.to_string(), "GPU");
        for s in ["gpu", "GPU", "Gpu", "gPu"] {
            assert_eq!(s.parse::<DeviceType>().unwrap(), DeviceType::Gpu);
        }
        assert_eq!("cpu".parse::<DeviceType>().unwrap(), DeviceType::Cpu);
        let err = "tpu".parse::<DeviceType>().unwrap_err().to_string();
        assert!(err.contains("\"tpu\"") && err.contains("expected CPU or GPU"), "{err}");
    }

    #[test]
    fn parses_full_form() {
        let spec = parse("/job:worker/replica:0/task:1/device:GPU:0");
        assert_eq!(
            spec,
            DeviceSpec {
                job: Some("worker".into()),
                replica: Some(0),
                task: Some(1),
                device_type: Some(DeviceType::Gpu),
                device_index: Some(0),
            }
        );
        assert_eq!(spec.to_string(), "/job:worker/replica:0/task:1/device:GPU:0");
    }

    #[test]
    fn parses_subsets_and_short_forms() {
        let cases: &[(&str, &str)] = &[
            ("/job:ps/task:0", "/job:ps/task:0"),
            ("/device:CPU:0", "/device:CPU:0"),
            ("/gpu:1", "/device:GPU:1"),
            ("/cpu:0", "/device:CPU:0"),
            ("GPU:0", "/device:GPU:0"),
            ("gpu:0", "/device:GPU:0"),
            ("/GPU:3", "/device:GPU:3"),
            ("/device:GPU:*", "/device:GPU:*"),
            ("/device:gpu", "/device:GPU:*"),
            ("gpu:*", "/device:GPU:*"),
            ("/device:*:2", "/device:*:2"),
            ("/job:worker/gpu:1", "/job:worker/device:GPU:1"),
            ("job:worker/task:3", "/job:worker/task:3"),
            ("/replica:2", "/replica:2"),
            ("/task:7/cpu:0", "/task:7/device:CPU:0"),
            ("  /device:CPU:0  ", "/device:CPU:0"),
            ("/JOB:chief/Task:0/Device:gpu:0", "/job:chief/task:0/device:GPU:0"),
            ("/job:worker-1_a", "/job:worker-1_a"),
            ("/", "/"),
            ("/device:GPU:4294967295", "/device:GPU:4294967295"),
        ];
        for (input, canonical) in cases {
            let spec = parse(input);
            assert_eq!(spec.to_string(), *canonical, "input {input:?}");
            assert_eq!(parse(canonical), spec, "canonical {canonical:?}");
        }
        let star = parse("/device:GPU:*");
        assert_eq!(star.device_type, Some(DeviceType::Gpu));
        assert_eq!(star.device_index, None);
        assert!(parse("/").is_empty());
    }

    #[test]
    fn round_trip_over_all_component_combinations() {
        let jobs = [None, Some("worker".to_string()), Some("ps".to_string())];
        let numbers = [None, Some(0), Some(7)];
        let types = [None, Some(DeviceType::Cpu), Some(DeviceType::Gpu)];
        let mut count = 0;
        for job in &jobs {
            for &replica in &numbers {
                for &task in &numbers {
                    for &device_type in &types {
                        for &device_index in &numbers {
                            let spec = DeviceSpec { job: job.clone(), replica, task, device_type, device_index };
                            let text = spec.to_string();
                            assert_eq!(parse(&text), spec, "via {text:?}");
                            count += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(count, 243);
    }

    #[test]
    fn errors_quote_the_input_and_the_expected_form() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("   ", "empty"),
            ("/foo:1", "unknown component \"foo:1\""),
            ("/job", "unknown component"),
            ("/device:TPU:0", "unknown device type \"TPU\""),
            ("/task:x", "bad task"),
            ("/task:1.5", "bad task"),
            ("/replica:+1", "bad replica"),
            ("/gpu:-1", "negative device index -1"),
            ("/task:-2", "negative task -2"),
            ("/replica:", "missing replica"),
            ("/gpu:", "missing device index"),
            ("/task:1/task:2", "duplicated task"),
            ("/gpu:0/cpu:0", "duplicated device"),
            ("/task:0/job:worker", "comes after the task component"),
            ("/device:GPU:0/replica:0", "comes after the device component"),
            ("/job:worker//task:0", "empty component"),
            ("/job:worker/", "empty component"),
            ("/job:1worker", "bad job name"),
            ("/job:", "bad job name"),
            ("/job:a b", "bad job name"),
            ("/device::0", "missing device type"),
            ("/gpu:0:1", "bad device index"),
            ("/gpu:99999999999", "too large"),
        ];
        for (input, needle) in cases {
            let msg = parse_err(input);
            assert!(msg.contains(&format!("{input:?}")), "{input:?}: message {msg:?} lacks the input");
            assert!(msg.contains(needle), "{input:?}: message {msg:?} lacks {needle:?}");
            assert!(msg.contains("expected") || msg.contains("at most once"), "{msg}");
            assert!(!msg.ends_with('.'), "{msg}");
        }
    }

    #[test]
    fn helpers() {
        assert_eq!(DeviceSpec::cpu(2).to_string(), "/device:CPU:2");
        assert_eq!(DeviceSpec::gpu(1).to_string(), "/device:GPU:1");
        assert_eq!(DeviceSpec::device(DeviceType::Gpu, 3), DeviceSpec::gpu(3));
        assert!(DeviceSpec::cpu(0).is_cpu() && !DeviceSpec::cpu(0).is_gpu());
        assert!(DeviceSpec::gpu(0).is_gpu() && !DeviceSpec::gpu(0).is_cpu());
        assert!(!DeviceSpec::default().is_cpu());
        let spec = DeviceSpec::gpu(0).with_job("worker").with_replica(0).with_task(1);
        assert_eq!(spec.to_string(), "/job:worker/replica:0/task:1/device:GPU:0");
        assert_eq!(spec.device_part(), DeviceSpec::gpu(0));
    }

    #[test]
    fn merge_fills_missing_components_only() {
        let mut spec = parse("/job:worker/gpu:1");
        spec.merge_from(&parse("/job:ps/replica:0/task:2/device:CPU:0"));
        assert_eq!(spec.to_string(), "/job:worker/replica:0/task:2/device:GPU:1");

        let mut partial = parse("/device:GPU:*");
        partial.merge_from(&parse("/task:0/device:GPU:3"));
        assert_eq!(partial.to_string(), "/task:0/device:GPU:3");

        let mut other_type = parse("/device:CPU:*");
        other_type.merge_from(&parse("/device:GPU:1"));
        assert_eq!(other_type.to_string(), "/device:CPU:*");

        let empty = DeviceSpec::default().merged(&parse("/job:w/task:1"));
        assert_eq!(empty.to_string(), "/job:w/task:1");
        // TF's make_merged_spec semantics (other wins) by merging the other way round.
        assert_eq!(
            parse("/job:ps/task:0").merged(&parse("/job:worker/gpu:0")).to_string(),
            "/job:ps/task:0/device:GPU:0"
        );
    }

    #[test]
    fn matches_checks_components_set_in_other() {
        let full = parse("/job:worker/replica:0/task:1/device:GPU:0");
        assert!(full.matches(&parse("/device:GPU:0")));
        assert!(full.matches(&parse("/job:worker")));
        assert!(full.matches(&parse("/gpu:*")));
        assert!(full.matches(&DeviceSpec::default()));
        assert!(full.matches(&full));
        assert!(!full.matches(&parse("/job:ps")));
        assert!(!full.matches(&parse("/gpu:1")));
        assert!(!full.matches(&parse("/cpu:0")));
        assert!(!full.matches(&parse("/task:0")));
        let any_gpu = parse("/device:GPU:*");
        assert!(!any_gpu.matches(&parse("/gpu:0")));
        assert!(any_gpu.matches(&parse("gpu:*")));
    }

    #[test]
    fn serde_uses_the_string_form() {
        let spec = parse("/job:worker/task:1/gpu:0");
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(json, "\"/job:worker/task:1/device:GPU:0\"");
        let back: DeviceSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
        let short: DeviceSpec = serde_json::from_str("\"cpu:0\"").unwrap();
        assert_eq!(short, DeviceSpec::cpu(0));
        let err = serde_json::from_str::<DeviceSpec>("\"/gpu:-1\"").unwrap_err().to_string();
        assert!(err.contains("negative"), "{err}");
        assert_eq!(serde_json::to_string(&DeviceType::Gpu).unwrap(), "\"GPU\"");
        assert_eq!(serde_json::from_str::<DeviceType>("\"cpu\"").unwrap(), DeviceType::Cpu);
    }
}

//! The `TF_CONFIG` resolver: the cluster JSON exactly as TensorFlow (and the Kubeflow TFJob
//! operator, Ray, Vertex AI...) writes it.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};
use serde_json::Value;
use strata_core::{Error, Result};

use super::resolver::ClusterResolver;
use super::spec::{check_task, ClusterConfig, ClusterSpec, TaskId, TaskType};

/// Resolves the cluster from a `TF_CONFIG` JSON:
///
/// ```json
/// {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]},
///  "task": {"type": "worker", "index": 1},
///  "rpc_layer": "grpc", "environment": "cloud"}
/// ```
///
/// `rpc_layer` and `environment` are optional, other top-level keys are ignored. When the
/// cluster has no `chief` job, `worker:0` acts as chief. An `evaluator` task may be absent
/// from `cluster` (TensorFlow runs the evaluator outside the cluster it evaluates).
///
/// ```
/// use strata_strategies::cluster::{ClusterResolver, TFConfigClusterResolver, TaskId};
/// let config = TFConfigClusterResolver::from_json(
///     r#"{"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"type": "worker", "index": 1}}"#,
/// )
/// .resolve()?;
/// assert_eq!(config.task, TaskId::worker(1));
/// assert_eq!(config.rank(), Some(1));
/// assert!(!config.is_chief());
/// # Ok::<(), strata_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TFConfigClusterResolver {
    json: String,
}

impl TFConfigClusterResolver {
    /// The environment variable read by [`from_env`](Self::from_env).
    pub const ENV_VAR: &'static str = "TF_CONFIG";

    /// A resolver over the `TF_CONFIG` environment variable; an error when it is not set.
    pub fn from_env() -> Result<Self> {
        match std::env::var(Self::ENV_VAR) {
            Ok(json) => Ok(TFConfigClusterResolver { json }),
            Err(std::env::VarError::NotPresent) => Err(Error::InvalidCluster(
                "TF_CONFIG is not set: export the cluster JSON, e.g. TF_CONFIG='{\"cluster\": {\"worker\": \
                 [\"host0:2222\", \"host1:2222\"]}, \"task\": {\"type\": \"worker\", \"index\": 0}}', or use another \
                 cluster resolver"
                    .into(),
            )),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::InvalidCluster("TF_CONFIG is not valid UTF-8; write it as a UTF-8 JSON string".into()))
            }
        }
    }

    /// A resolver over a TF_CONFIG JSON string (parsed by [`resolve`](ClusterResolver::resolve)).
    pub fn from_json(json: impl Into<String>) -> Self {
        TFConfigClusterResolver { json: json.into() }
    }

    /// The JSON this resolver reads.
    pub fn json(&self) -> &str {
        &self.json
    }
}

impl ClusterResolver for TFConfigClusterResolver {
    fn source(&self) -> &'static str {
        "TF_CONFIG"
    }

    fn resolve(&self) -> Result<ClusterConfig> {
        parse_tf_config(&self.json)
    }
}

/// Parses a TF_CONFIG JSON; errors start with `TF_CONFIG` and name the field.
pub(crate) fn parse_tf_config(json: &str) -> Result<ClusterConfig> {
    let invalid = |m: String| Error::InvalidCluster(format!("TF_CONFIG: {m}"));
    if json.trim().is_empty() {
        return Err(Error::InvalidCluster(
            "TF_CONFIG is empty; set it to the cluster JSON, {\"cluster\": {...}, \"task\": {\"type\": ..., \
             \"index\": ...}}"
                .into(),
        ));
    }
    let value: Value = serde_json::from_str(json)
        .map_err(|e| Error::InvalidCluster(format!("TF_CONFIG is not valid JSON: {e}; fix the JSON there")))?;
    parse_tf_config_value(&value).map_err(invalid)
}

/// Parses a parsed TF_CONFIG; messages name the field (`task.index 3 is out of range: ...`).
pub(crate) fn parse_tf_config_value(value: &Value) -> std::result::Result<ClusterConfig, String> {
    let Value::Object(top) = value else {
        return Err(format!("expected a JSON object with \"cluster\" and \"task\", got {}", describe(value)));
    };
    let spec = match top.get("cluster") {
        None | Some(Value::Null) => {
            return Err("missing \"cluster\": add \"cluster\": {\"worker\": [\"host:port\", ...]} listing every \
                        task's address"
                .into())
        }
        Some(cluster) => parse_cluster(cluster, "cluster.")?,
    };
    let task = match top.get("task") {
        None | Some(Value::Null) => {
            return Err("missing \"task\": add \"task\": {\"type\": \"worker\", \"index\": 0} naming this process's \
                        task"
                .into())
        }
        Some(Value::Object(task)) => task,
        Some(other) => {
            return Err(format!(
                "\"task\" must be an object like {{\"type\": \"worker\", \"index\": 0}}, got {}",
                describe(other)
            ))
        }
    };
    let kind = match task.get("type") {
        None | Some(Value::Null) => {
            return Err("missing task.type: add \"type\": \"worker\" (or \"chief\", \"ps\", \"evaluator\") to \
                        \"task\""
                .into())
        }
        Some(Value::String(name)) => TaskType::parse(name).map_err(|m| format!("task.type {m}"))?,
        Some(other) => return Err(format!("task.type must be a job name such as \"worker\", got {}", describe(other))),
    };
    let index = match task.get("index") {
        None | Some(Value::Null) => {
            return Err("missing task.index: add \"index\": 0 (the task's position in its job) to \"task\"".into())
        }
        Some(v) => parse_index(v)?,
    };
    let task = TaskId::new(kind, index);
    check_task(&spec, task, &format!("task.type \"{kind}\""), &format!("task.index {index}"))?;
    Ok(ClusterConfig {
        spec,
        task,
        rpc_layer: optional_string(top.get("rpc_layer"), "rpc_layer", "\"grpc\"")?,
        environment: optional_string(top.get("environment"), "environment", "\"cloud\"")?,
    })
}

/// Parses a cluster dict; `path` (`"cluster."`) prefixes the fields in messages.
pub(crate) fn parse_cluster(value: &Value, path: &str) -> std::result::Result<ClusterSpec, String> {
    let name = path.trim_end_matches('.');
    let Value::Object(jobs) = value else {
        return Err(format!(
            "{name} must be an object of job names to lists of \"host:port\" addresses, got {}",
            describe(value)
        ));
    };
    let mut map = BTreeMap::new();
    for (job, addresses) in jobs {
        let kind = TaskType::parse(job).map_err(|m| format!("{name}: {m}"))?;
        let list = match addresses {
            Value::Array(list) => list,
            Value::Object(_) => {
                return Err(format!(
                    "{path}{job} is an object; write it as a list of \"host:port\" strings (the sparse {{\"0\": \
                     \"host:port\"}} form is not supported)"
                ))
            }
            other => {
                return Err(format!("{path}{job} must be a list of \"host:port\" strings, got {}", describe(other)))
            }
        };
        let mut strings = Vec::with_capacity(list.len());
        for (i, address) in list.iter().enumerate() {
            match address {
                Value::String(s) => strings.push(s.clone()),
                other => {
                    return Err(format!("{path}{job}[{i}] must be a \"host:port\" string, got {}", describe(other)))
                }
            }
        }
        // JSON object keys are unique after parsing, so each job comes once.
        map.insert(kind, strings);
    }
    ClusterSpec::validated(map, path)
}

/// Parses `task.index`: a non-negative integer.
fn parse_index(value: &Value) -> std::result::Result<usize, String> {
    match value {
        Value::Number(n) => {
            if let Some(i) = n.as_u64() {
                usize::try_from(i)
                    .map_err(|_| format!("task.index {i} is too large; use the task's position in its job"))
            } else if n.as_i64().is_some() {
                Err(format!("task.index {n} is negative; use the task's position in its job, from 0"))
            } else {
                Err(format!("task.index {n} is not an integer; use the task's position in its job, from 0"))
            }
        }
        Value::String(s) => Err(format!(
            "task.index {s:?} is a string; write it as a number without quotes, e.g. \"index\": {}",
            s.trim().parse::<usize>().unwrap_or(0)
        )),
        other => Err(format!("task.index must be a non-negative integer, got {}", describe(other))),
    }
}

/// An optional string field (`rpc_layer`, `environment`); an empty string counts as absent.
fn optional_string(value: Option<&Value>, field: &str, example: &str) -> std::result::Result<Option<String>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("{field} must be a string such as {example}, got {}", describe(other))),
    }
}

/// A short description of a JSON value for messages: `a number (1.5)`, `an array`.
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("a boolean ({b})"),
        Value::Number(n) => format!("a number ({n})"),
        Value::String(s) => format!("a string ({s:?})"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

// TF_CONFIG's JSON is how the spec and the config deserialize: one parser, with its messages.

impl<'de> Deserialize<'de> for ClusterSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        parse_cluster(&value, "cluster.").map_err(serde::de::Error::custom)
    }
}

impl ClusterConfig {
    /// Parses a TF_CONFIG JSON (same as [`TFConfigClusterResolver::from_json`] and `resolve`).
    pub fn from_tf_config(json: &str) -> Result<Self> {
        parse_tf_config(json)
    }
}

impl<'de> Deserialize<'de> for ClusterConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        parse_tf_config_value(&value).map_err(serde::de::Error::custom)
    }
}

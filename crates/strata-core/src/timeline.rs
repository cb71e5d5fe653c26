//! A timeline of every replica's step phases, written as a Chrome trace (open it in Perfetto
//! or `chrome://tracing`), as Horovod's timeline does.
//!
//! Each replica is a thread row (`tid` = replica id); each phase (forward, backward, a bucket's
//! reduction, the optimizer step) is a complete event (`"ph": "X"`).

use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use crate::{Error, Result};

#[derive(Debug, Clone, serde::Serialize)]
struct Event {
    name: String,
    cat: &'static str,
    ph: &'static str,
    ts: f64,
    dur: f64,
    pid: u32,
    tid: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<serde_json::Value>,
}

/// Records step phases of every replica.
#[derive(Debug)]
pub struct Timeline {
    origin: Instant,
    events: Mutex<Vec<Event>>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    /// An empty timeline whose clock starts now.
    pub fn new() -> Self {
        Self { origin: Instant::now(), events: Mutex::new(Vec::new()) }
    }

    /// Starts a phase on `replica`; it ends when the guard drops.
    pub fn span(&self, replica: usize, cat: &'static str, name: impl Into<String>) -> TimelineSpan<'_> {
        TimelineSpan { timeline: self, replica, cat, name: name.into(), start: Instant::now(), args: None }
    }

    /// The number of events recorded so far.
    pub fn len(&self) -> usize {
        self.events.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The names of the recorded events, in recording order (for tests and summaries).
    pub fn event_names(&self) -> Vec<(usize, String)> {
        let ev = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        ev.iter().map(|e| (e.tid, e.name.clone())).collect()
    }

    /// Writes the Chrome trace JSON to `path`.
    pub fn write_chrome_trace(&self, path: &Path) -> Result<()> {
        let ev = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        let replicas: std::collections::BTreeSet<usize> = ev.iter().map(|e| e.tid).collect();
        let mut events: Vec<serde_json::Value> = replicas
            .iter()
            .map(|r| {
                serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": r,
                    "args": {"name": format!("replica {r}")}})
            })
            .collect();
        events.extend(ev.iter().map(|e| serde_json::to_value(e).unwrap_or_default()));
        let doc = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        let mut f = std::fs::File::create(path)
            .map_err(|e| Error::io(format!("cannot create timeline {}", path.display()), e))?;
        serde_json::to_writer(&mut f, &doc)
            .map_err(|e| Error::io(format!("cannot write timeline {}", path.display()), e.into()))?;
        f.flush().map_err(|e| Error::io(format!("cannot write timeline {}", path.display()), e))
    }
}

/// A phase in progress; recorded when dropped.
pub struct TimelineSpan<'a> {
    timeline: &'a Timeline,
    replica: usize,
    cat: &'static str,
    name: String,
    start: Instant,
    args: Option<serde_json::Value>,
}

impl TimelineSpan<'_> {
    /// Attaches arguments shown in the trace viewer (sizes, step numbers).
    pub fn with_args(mut self, args: serde_json::Value) -> Self {
        self.args = Some(args);
        self
    }
}

impl Drop for TimelineSpan<'_> {
    fn drop(&mut self) {
        let ts = self.start.duration_since(self.timeline.origin).as_secs_f64() * 1e6;
        let dur = self.start.elapsed().as_secs_f64() * 1e6;
        let e = Event {
            name: std::mem::take(&mut self.name),
            cat: self.cat,
            ph: "X",
            ts,
            dur,
            pid: 1,
            tid: self.replica,
            args: self.args.take(),
        };
        self.timeline.events.lock().unwrap_or_else(PoisonError::into_inner).push(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_chrome_trace() {
        let t = Timeline::new();
        {
            let _a = t.span(0, "step", "forward");
            let _b = t.span(1, "reduce", "bucket 0").with_args(serde_json::json!({"bytes": 4}));
        }
        let dir = std::env::temp_dir().join(format!("strata-tl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.json");
        t.write_chrome_trace(&p).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        assert_eq!(ev.iter().filter(|e| e["ph"] == "X").count(), 2);
        assert_eq!(ev.iter().filter(|e| e["ph"] == "M").count(), 2);
        assert!(ev.iter().any(|e| e["name"] == "bucket 0" && e["tid"] == 1 && e["args"]["bytes"] == 4));
        std::fs::remove_dir_all(dir).ok();
    }
}

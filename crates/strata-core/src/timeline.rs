//! A timeline of every replica's step phases, written as a Chrome trace (open it in Perfetto
//! or `chrome://tracing`), as Horovod's timeline does.
//!
//! Each replica is a thread row (`tid` = replica id); each phase (forward, backward, a bucket's
//! reduction, the optimizer step) is a complete event (`"ph": "X"`). Times are microseconds of
//! the wall clock since the Unix epoch, so that the traces of a job's processes (one per
//! worker, each its own `pid`, see [`Timeline::write_process_trace`]) line up when their
//! `traceEvents` are joined into one file. Every phase carries the CPU time its thread spent
//! in it (`args.cpu_ms`): a phase whose CPU time is well under its duration waited (on a peer,
//! or for a core that another thread held).
//!
//! Row [`Timeline::RING`] is the thread that runs a multi-worker job's collectives across
//! workers: each collective is a phase there, with the bytes it reduced.

use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

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
    /// `origin` on the wall clock: microseconds since the Unix epoch.
    origin_us: f64,
    events: Mutex<Vec<Event>>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

/// The CPU time this thread has run, in microseconds.
fn thread_cpu_us() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 * 1e6 + t.tv_nsec as f64 / 1e3
}

impl Timeline {
    /// The row of the thread that runs collectives across workers (shown as "ring").
    pub const RING: usize = 1 << 16;

    /// An empty timeline whose clock starts now.
    pub fn new() -> Self {
        let origin_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e6);
        Self { origin: Instant::now(), origin_us, events: Mutex::new(Vec::new()) }
    }

    /// Starts a phase on `replica`; it ends when the guard drops.
    pub fn span(&self, replica: usize, cat: &'static str, name: impl Into<String>) -> TimelineSpan<'_> {
        TimelineSpan {
            timeline: self,
            replica,
            cat,
            name: name.into(),
            start: Instant::now(),
            cpu_us: thread_cpu_us(),
            args: None,
        }
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

    /// Writes the Chrome trace JSON to `path`, as process 1.
    pub fn write_chrome_trace(&self, path: &Path) -> Result<()> {
        self.write_process_trace(path, 1, None)
    }

    /// Writes the Chrome trace JSON to `path` as process `pid`, named `process` in the viewer
    /// (`"worker 1"`): one file per process of a job, whose events can be joined into one
    /// trace (`jq -s '{traceEvents: map(.traceEvents) | add}' a.json b.json`).
    pub fn write_process_trace(&self, path: &Path, pid: u32, process: Option<&str>) -> Result<()> {
        let ev = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        let replicas: std::collections::BTreeSet<usize> = ev.iter().map(|e| e.tid).collect();
        let mut events: Vec<serde_json::Value> = process
            .map(|name| serde_json::json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}))
            .into_iter()
            .collect();
        events.extend(replicas.iter().map(|r| {
            let name = if *r == Self::RING { "ring".to_string() } else { format!("replica {r}") };
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": r, "args": {"name": name}})
        }));
        events.extend(ev.iter().map(|e| {
            let e = Event { pid, ts: e.ts + self.origin_us, ..e.clone() };
            serde_json::to_value(e).unwrap_or_default()
        }));
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
    /// The thread's CPU time at the start.
    cpu_us: f64,
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
        // Milliseconds, to the microsecond.
        let cpu_ms = serde_json::json!((thread_cpu_us() - self.cpu_us).round() / 1e3);
        let args = match self.args.take() {
            Some(serde_json::Value::Object(mut m)) => {
                m.insert("cpu_ms".into(), cpu_ms);
                serde_json::Value::Object(m)
            }
            Some(other) => serde_json::json!({ "value": other, "cpu_ms": cpu_ms }),
            None => serde_json::json!({ "cpu_ms": cpu_ms }),
        };
        let e = Event {
            name: std::mem::take(&mut self.name),
            cat: self.cat,
            ph: "X",
            ts,
            dur,
            pid: 1,
            tid: self.replica,
            args: Some(args),
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
        assert!(ev.iter().filter(|e| e["ph"] == "X").all(|e| e["args"]["cpu_ms"].as_f64().is_some_and(|c| c >= 0.0)));
        std::fs::remove_dir_all(dir).ok();
    }
}

//! Lost workers: `[injection] kill` kills a run's worker process from outside (SIGKILL, as the
//! kernel's OOM killer, a dead host or a preempted pod would) once the job has trained a
//! number of global batches, and records when.
//!
//! The runner polls the run's metrics file; a [`Killer`] reads how far the job has got from
//! its last step record and, when a kill is due, finds the worker's process among the run's
//! descendants by the `STRATA_TASK=worker:INDEX` that `strata launch` and a parameter-server
//! job's local cluster give every task. Each kill happens once: a process that replaces the
//! worker (a restart, a relaunch) is not killed again.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use crate::experiment::Kill;

/// A worker the harness killed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FaultEvent {
    /// The worker task's index.
    pub worker: usize,
    /// The global batch the kill was due at.
    pub at_step: u64,
    /// The global batches the job had trained when the worker was killed (the last step
    /// record read; the poll lags the job by a few steps at most).
    pub step: u64,
    /// Seconds from the run's start.
    pub wall_s: f64,
}

/// The kills of one run, due as the job's step records arrive, and the clocks that put them
/// on the records' time axis.
///
/// A record's `wall_s` counts from its trainer's start, which is later than the harness's
/// start of the run (processes start, data loads) and, after a relaunch, from the new
/// trainer's start. The killer watches records arrive: the smallest difference between the
/// harness's clock when a record is first read and the record's `wall_s` is each attempt's
/// offset, to within the poll interval. Kills and a relaunched job's records are placed on
/// the first attempt's axis, the one every other run's records use.
#[derive(Debug)]
pub struct Killer {
    pending: Vec<Kill>,
    /// Step records per global batch (a parameter-server job's pushes: its workers).
    per_batch: u64,
    started: Instant,
    /// This attempt's offset: harness seconds minus record seconds.
    attempt_offset: Option<f64>,
    /// The first attempt's.
    first_offset: Option<f64>,
    /// The kills done.
    pub done: Vec<FaultEvent>,
}

impl Killer {
    /// The kills of `kills` for a run that started at `started` and records `per_batch` steps
    /// per global batch.
    pub fn new(kills: &[Kill], per_batch: u64, started: Instant) -> Self {
        Self {
            pending: kills.to_vec(),
            per_batch: per_batch.max(1),
            started,
            attempt_offset: None,
            first_offset: None,
            done: Vec::new(),
        }
    }

    /// Whether the run has kills at all (its clocks are watched closely).
    pub fn is_active(&self) -> bool {
        !self.pending.is_empty() || !self.done.is_empty()
    }

    /// Whether a kill is still to come.
    pub fn is_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Reads the metrics file's last step record: notes the clocks' offset and returns the
    /// global batches trained.
    pub fn observe(&mut self, metrics: &str) -> Option<u64> {
        let line = metrics.lines().rev().find(|l| l.contains("\"kind\":\"step\""))?;
        let record: strata::metrics::MetricRecord = serde_json::from_str(line).ok()?;
        let offset = self.started.elapsed().as_secs_f64() - record.wall_s;
        self.attempt_offset = Some(self.attempt_offset.map_or(offset, |o| o.min(offset)));
        Some(record.step / self.per_batch)
    }

    /// Ends an attempt (the job's processes exited): how far its records' `wall_s` are moved
    /// to lie on the first attempt's axis (`fallback`, the attempt's start on the harness's
    /// clock, where no record was seen).
    pub fn end_attempt(&mut self, fallback: f64) -> f64 {
        let shift = match (self.attempt_offset.take(), self.first_offset) {
            (Some(o), Some(first)) => o - first,
            (Some(o), None) => {
                self.first_offset = Some(o);
                0.0
            }
            (None, first) => fallback - first.unwrap_or(0.0),
        };
        if self.first_offset.is_none() {
            self.first_offset = Some(0.0);
        }
        shift
    }

    /// Seconds on the first attempt's axis now.
    fn now_on_axis(&self) -> f64 {
        let offset = self.first_offset.or(self.attempt_offset).unwrap_or(0.0);
        self.started.elapsed().as_secs_f64() - offset
    }

    /// Kills every worker whose kill is due at `progress`, among the descendants of `root`.
    /// A worker whose process cannot be found yet stays pending.
    pub fn poll(&mut self, root: u32, progress: u64) {
        let mut i = 0;
        while i < self.pending.len() {
            let k = self.pending[i];
            if progress < k.at_step {
                i += 1;
                continue;
            }
            match find_task(root, &format!("worker:{}", k.worker)) {
                Some(pid) => {
                    use nix::sys::signal::{kill, Signal};
                    let _ = kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL);
                    self.done.push(FaultEvent {
                        worker: k.worker,
                        at_step: k.at_step,
                        step: progress,
                        wall_s: self.now_on_axis(),
                    });
                    self.pending.remove(i);
                }
                None => i += 1,
            }
        }
    }
}

/// The process among `root`'s descendants whose environment names `task`
/// (`STRATA_TASK=worker:1`).
pub fn find_task(root: u32, task: &str) -> Option<u32> {
    let want = format!("{}={task}", "STRATA_TASK");
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if let Some(ppid) = parent_of(&entry.path().join("stat")) {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut seen = HashSet::new();
    let mut queue = vec![root];
    while let Some(p) = queue.pop() {
        if !seen.insert(p) {
            continue;
        }
        if p != root {
            let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            if env.split(|b| *b == 0).any(|v| v == want.as_bytes()) && !is_zombie(p) {
                return Some(p);
            }
        }
        queue.extend(children.get(&p).into_iter().flatten());
    }
    None
}

/// The parent pid in `/proc/PID/stat` (the field after the state, after the command's
/// closing parenthesis).
fn parent_of(stat: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(stat).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| t.rfind(')').map(|i| t[i + 1..].trim_start().starts_with('Z')))
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kill_finds_the_task_among_the_descendants_and_happens_once() {
        // A shell (the "launcher") whose child is the "task": found through the tree and its
        // environment, not by name.
        let mut launcher = std::process::Command::new("sh")
            .args(["-c", "STRATA_TASK=worker:1 sleep 30 & STRATA_TASK=worker:0 sleep 30 & wait"])
            .spawn()
            .unwrap();
        let root = launcher.id();
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while find_task(root, "worker:0").is_none() && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let victim = find_task(root, "worker:1").expect("worker:1 among the descendants");
        assert_ne!(Some(victim), find_task(root, "worker:0"));
        assert_eq!(find_task(std::process::id(), "worker:7"), None);
        let mut k = Killer::new(&[Kill { worker: 1, at_step: 3 }], 2, Instant::now());
        let metrics = "{\"kind\":\"step\",\"step\":4,\"updates\":4,\"wall_s\":0.1,\"examples\":64}\n";
        assert_eq!(k.observe(metrics), Some(2));
        k.poll(root, 2);
        assert!(k.is_pending() && k.done.is_empty(), "not due before 3 global batches");
        k.poll(root, 3);
        assert_eq!(k.done.len(), 1);
        assert_eq!((k.done[0].worker, k.done[0].step), (1, 3));
        assert!(!k.is_pending());
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while find_task(root, "worker:1").is_some() && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(find_task(root, "worker:1"), None, "worker:1 was killed");
        k.poll(root, 10);
        assert_eq!(k.done.len(), 1, "a kill happens once");
        let _ = launcher.kill();
        let _ = launcher.wait();
        if let Some(p) = find_task(root, "worker:0") {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

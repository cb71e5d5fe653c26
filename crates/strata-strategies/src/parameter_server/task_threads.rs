//! Threads that make a worker's calls to its ps tasks in parallel, one per task, kept for as
//! long as their owner. A thread started for every call begins with a fresh allocator heap,
//! whose first pages the kernel clears on first touch (2 MiB at a time under transparent huge
//! pages): a hybrid job of the click model had 4.7x the page faults and 9% more CPU than with
//! its calls made from one thread (`docs/bench/2026-12-06-2300-ctr-rows-with-pull.md`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Mutex, PoisonError};

use strata_core::{Error, Result};

/// A job for a task's thread.
type Job = Box<dyn FnOnce() + Send + 'static>;

/// A call to one ps task, run by [`TaskThreads::run`].
pub(crate) type TaskCall<R> = Box<dyn FnOnce() -> Result<R> + Send + 'static>;

/// One thread per ps task, started at its first call and kept until this is dropped (each
/// then ends after its job in hand).
#[derive(Debug, Default)]
pub(crate) struct TaskThreads {
    senders: Mutex<Vec<Option<mpsc::Sender<Job>>>>,
}

/// Calls started on a [`TaskThreads`], their results still to come.
#[derive(Debug)]
pub(crate) struct Started<R> {
    waiting: Vec<Result<mpsc::Receiver<Result<R>>>>,
}

impl<R> Started<R> {
    /// No calls.
    pub(crate) fn empty() -> Self {
        Self { waiting: Vec::new() }
    }

    /// Waits for every call; their results in order. A call that panicked is an error naming
    /// `what`.
    pub(crate) fn wait(self, what: &str) -> Vec<Result<R>> {
        self.waiting.into_iter().map(|rx| rx.and_then(|rx| rx.recv().unwrap_or_else(|_| Err(panicked(what))))).collect()
    }
}

fn panicked(what: &str) -> Error {
    Error::Cluster(format!("a {what} call panicked"))
}

impl TaskThreads {
    /// Runs the calls of `calls` at once, call `k` on thread `k` and the last on the calling
    /// thread; their results in order. A call that panicked is an error naming `what` (its
    /// thread goes on serving).
    pub(crate) fn run<R: Send + 'static>(&self, what: &str, mut calls: Vec<TaskCall<R>>) -> Vec<Result<R>> {
        let last = calls.pop();
        let started = self.start(calls);
        let mine = last.map(|call| catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|_| Err(panicked(what))));
        let mut out = started.wait(what);
        out.extend(mine);
        out
    }

    /// Starts the calls of `calls` on the threads, call `k` on thread `k`, and returns at once:
    /// [`Started::wait`] gives their results in order.
    pub(crate) fn start<R: Send + 'static>(&self, calls: Vec<TaskCall<R>>) -> Started<R> {
        let waiting = calls
            .into_iter()
            .enumerate()
            .map(|(k, call)| {
                let (tx, rx) = mpsc::sync_channel(1);
                self.send(k, Box::new(move || drop(tx.send(call()))))?;
                Ok(rx)
            })
            .collect();
        Started { waiting }
    }

    /// Hands `job` to thread `k`, starting it if it is not running.
    fn send(&self, k: usize, job: Job) -> Result<()> {
        let mut senders = self.senders.lock().unwrap_or_else(PoisonError::into_inner);
        if senders.len() <= k {
            senders.resize_with(k + 1, || None);
        }
        let job = match &senders[k] {
            Some(tx) => match tx.send(job) {
                Ok(()) => return Ok(()),
                Err(mpsc::SendError(job)) => job,
            },
            None => job,
        };
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(format!("strata-ps-calls-{k}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A panicking call drops its answer's sender: the caller sees the panic.
                    let _ = catch_unwind(AssertUnwindSafe(job));
                }
            })
            .map_err(|e| Error::Cluster(format!("cannot start the thread that calls ps task {k}: {e}")))?;
        tx.send(job).map_err(|_| Error::Cluster(format!("the thread that calls ps task {k} stopped at once")))?;
        senders[k] = Some(tx);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_run_at_once_in_order_on_threads_that_stay() {
        let threads = TaskThreads::default();
        for round in 0..3 {
            let calls: Vec<TaskCall<(usize, String)>> = (0..3)
                .map(|k| -> TaskCall<(usize, String)> {
                    Box::new(move || Ok((k, std::thread::current().name().unwrap_or("caller").to_string())))
                })
                .collect();
            let got: Vec<(usize, String)> = threads.run("test", calls).into_iter().map(|r| r.unwrap()).collect();
            assert_eq!(got[0], (0, "strata-ps-calls-0".to_string()), "round {round}");
            assert_eq!(got[1], (1, "strata-ps-calls-1".to_string()), "round {round}");
            // The last runs on the calling thread.
            assert_eq!(got[2].0, 2);
            assert_ne!(got[2].1, "strata-ps-calls-2");
        }
        assert_eq!(threads.senders.lock().unwrap().len(), 2);
    }

    /// Started calls run on the threads, every one (none on the caller), while the caller goes
    /// on; `wait` gives their results in order, a panic as an error.
    #[test]
    fn started_calls_run_on_the_threads_while_the_caller_goes_on() {
        let threads = TaskThreads::default();
        let (go, gate) = mpsc::channel::<()>();
        let gate = Mutex::new(gate);
        let gate = std::sync::Arc::new(gate);
        let g = gate.clone();
        let calls: Vec<TaskCall<String>> = vec![
            Box::new(move || {
                // Returns only once the caller, having got `start`'s answer, says so.
                g.lock().unwrap().recv().unwrap();
                Ok(std::thread::current().name().unwrap_or("").to_string())
            }),
            Box::new(|| Ok(std::thread::current().name().unwrap_or("").to_string())),
            Box::new(|| panic!("boom")),
        ];
        let started = threads.start(calls);
        go.send(()).unwrap();
        let got = started.wait("rows pull");
        assert_eq!(got[0].as_ref().unwrap(), "strata-ps-calls-0");
        assert_eq!(got[1].as_ref().unwrap(), "strata-ps-calls-1");
        assert_eq!(got[2].as_ref().unwrap_err().to_string(), panicked("rows pull").to_string());
        assert_eq!(threads.senders.lock().unwrap().len(), 3);
    }

    #[test]
    fn a_panicking_call_is_an_error_and_its_thread_serves_on() {
        let threads = TaskThreads::default();
        let calls: Vec<TaskCall<u32>> = vec![Box::new(|| panic!("boom")), Box::new(|| Ok(7))];
        let got = threads.run("rows pull", calls);
        assert_eq!(got[0].as_ref().unwrap_err().to_string(), panicked("rows pull").to_string());
        assert_eq!(*got[1].as_ref().unwrap(), 7);
        let calls: Vec<TaskCall<u32>> = vec![Box::new(|| Ok(1)), Box::new(|| Ok(2))];
        let got: Vec<u32> = threads.run("rows pull", calls).into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(got, [1, 2]);
    }
}

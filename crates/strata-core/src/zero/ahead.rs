//! Stage 3 across workers: the unit a replica uses next, pulled ahead while it computes with
//! the current one ([`Ahead`]), as FSDP2 prefetches the next module in the order its last
//! step recorded.
//!
//! Each local copy records the units it brings back in a step, in order; in the next step,
//! when it brings back its `i`-th unit, the unit that came `i + 1`-th last time is pulled on a
//! thread of its own, into a value kept here until the copy's use of it asks
//! ([`Ahead::take`]). A model that uses its units in another order than last time only loses
//! the head start: a value pulled ahead is taken only at the version it was pulled at, and
//! dropped at the copy's next step.
//!
//! This module must not know where the values come from: [`Residency`](super::Residency)
//! pulls them and hands them in.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use candle_core::Tensor;

/// What is pulled ahead, and the order each copy used its units in.
#[derive(Debug)]
pub(super) struct Ahead {
    order: Vec<Mutex<Order>>,
    /// By (copy, variable): the version pulled at and, once pulled, the value or why not.
    values: Mutex<HashMap<(usize, usize), Entry>>,
    /// Notified when a value arrives.
    arrived: Condvar,
}

/// The units a copy brought back in its last step, and so far in this one.
#[derive(Debug, Default)]
struct Order {
    last: Vec<usize>,
    this: Vec<usize>,
}

#[derive(Debug)]
struct Entry {
    version: u64,
    value: Option<std::result::Result<Tensor, String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Ahead {
    pub(super) fn new(copies: usize) -> Self {
        Self {
            order: (0..copies).map(|_| Mutex::new(Order::default())).collect(),
            values: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        }
    }

    /// Copy `copy` brought unit `unit` back: the unit that followed it in the copy's last step
    /// (the next to pull ahead), if any.
    pub(super) fn entered(&self, copy: usize, unit: usize) -> Option<usize> {
        let mut o = lock(&self.order[copy]);
        o.this.push(unit);
        o.last.get(o.this.len()).copied().filter(|&u| u != unit)
    }

    /// Copy `copy` stepped: this step's order becomes the last one, and what was pulled ahead
    /// for the copy is dropped (its version is past). Returns the unit the next step starts
    /// with, to pull ahead.
    pub(super) fn stepped(&self, copy: usize) -> Option<usize> {
        let first = {
            let mut o = lock(&self.order[copy]);
            o.last = std::mem::take(&mut o.this);
            o.last.first().copied()
        };
        lock(&self.values).retain(|&(c, _), e| c != copy || e.value.is_none());
        first
    }

    /// Marks `vars` of copy `copy` as being pulled at `version`, dropping whatever else was
    /// pulled ahead for the copy and not taken but the values of `current` (the unit in use,
    /// which may still take them); returns those not marked already.
    pub(super) fn claim(&self, copy: usize, vars: &[usize], current: &[usize], version: u64) -> Vec<usize> {
        let mut values = lock(&self.values);
        values.retain(|&(c, v), e| c != copy || e.value.is_none() || vars.contains(&v) || current.contains(&v));
        let mut claimed = Vec::with_capacity(vars.len());
        for &v in vars {
            match values.get(&(copy, v)) {
                Some(e) if e.version == version => {}
                _ => {
                    values.insert((copy, v), Entry { version, value: None });
                    claimed.push(v);
                }
            }
        }
        claimed
    }

    /// The value of variable `var` of copy `copy` pulled at `version`, or why it could not be.
    pub(super) fn put(&self, copy: usize, var: usize, version: u64, value: std::result::Result<Tensor, String>) {
        let mut values = lock(&self.values);
        if let Some(e) = values.get_mut(&(copy, var)).filter(|e| e.version == version) {
            e.value = Some(value);
        }
        self.arrived.notify_all();
    }

    /// The value of variable `var` of copy `copy` pulled ahead at `version`, waiting for it
    /// while it is being pulled; `None` where it was not pulled ahead at that version.
    pub(super) fn take(&self, copy: usize, var: usize, version: u64) -> Option<std::result::Result<Tensor, String>> {
        let mut values = lock(&self.values);
        loop {
            match values.get(&(copy, var)) {
                None => return None,
                Some(e) if e.version != version => {
                    values.remove(&(copy, var));
                    return None;
                }
                Some(Entry { value: None, .. }) => {
                    values = self.arrived.wait(values).unwrap_or_else(PoisonError::into_inner);
                }
                Some(_) => return values.remove(&(copy, var)).and_then(|e| e.value),
            }
        }
    }

    /// Drops copy `copy`'s claims that no thread will fill.
    pub(super) fn clear_claims(&self, copy: usize) {
        lock(&self.values).retain(|&(c, _), e| c != copy || e.value.is_some());
        self.arrived.notify_all();
    }

    /// Drops everything pulled ahead (the variables stay whole from now on).
    pub(super) fn clear(&self) {
        lock(&self.values).retain(|_, e| e.value.is_none());
    }
}

//! A push whose gradients are handed over while they are computed ([`StagedPush`], sent by
//! [`PsClient::push_staged`](super::PsClient::push_staged)).
//!
//! The push is one `Push` call, as any other: its header (every variable it carries) goes
//! first, then each variable's chunks as soon as the variable is staged, in the order they are
//! staged (the chunks of one variable stay in order; a task takes variables interleaved). The
//! call ends, and the task applies the push, only after [`StagedPush::commit`]; after
//! [`StagedPush::abandon`] the call is cancelled before its end, so the task applies nothing of
//! it. The staged gradients are kept until the push is answered, so a retried call sends them
//! all again.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use super::F32Bytes;

/// What a [`StagedPush`] holds so far.
#[derive(Debug, Default)]
struct Staged {
    /// The elements of every variable of the push, by the header's index.
    lens: Vec<usize>,
    /// Each variable's gradient once staged.
    data: Vec<Option<F32Bytes>>,
    /// The variables staged, in the order they were.
    order: Vec<usize>,
    committed: bool,
    abandoned: bool,
}

/// The next thing a sending call takes from a [`StagedPush`].
pub(crate) enum Next {
    /// The `i`-th variable staged: its index in the header, and its gradient.
    Variable(usize, F32Bytes),
    /// Everything was staged and the push committed: the call ends.
    End,
    /// The push was abandoned: the call is cancelled.
    Abandoned,
}

/// Why a [`StagedPush`] did not take a gradient.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StageError {
    /// The push has no variable of that index.
    #[error("variable #{index} is not in the push, which carries {count}")]
    UnknownVariable {
        /// The index given.
        index: usize,
        /// How many variables the push carries.
        count: usize,
    },
    /// The gradient has the wrong number of elements.
    #[error("variable #{index} has {want} elements, its gradient {got}")]
    WrongLength {
        /// The variable's index in the push.
        index: usize,
        /// Its elements.
        want: usize,
        /// The gradient's.
        got: usize,
    },
    /// The variable was staged before.
    #[error("variable #{index} was staged twice")]
    StagedTwice {
        /// The variable's index in the push.
        index: usize,
    },
    /// The push was committed or abandoned already.
    #[error("the push was already committed or abandoned")]
    Closed,
    /// A commit before every variable was staged.
    #[error("the push was committed with {missing} of its {count} variables not staged")]
    Incomplete {
        /// Variables not staged.
        missing: usize,
        /// Variables of the push.
        count: usize,
    },
}

/// The gradients of one push, staged one variable at a time while a [`PsClient`] call sends
/// them: the call's header names every variable first, then each variable's chunks go as soon
/// as it is staged; the task applies the push only after [`StagedPush::commit`], and nothing of
/// it after [`StagedPush::abandon`]. Shared between the thread that stages and the one sending.
///
/// [`PsClient`]: super::PsClient
#[derive(Debug, Default)]
pub struct StagedPush {
    state: Mutex<Staged>,
    changed: Condvar,
}

impl StagedPush {
    /// A push of variables of `lens` elements (in the order of the names the push is sent with).
    pub fn new(lens: Vec<usize>) -> Self {
        let data = vec![None; lens.len()];
        Self { state: Mutex::new(Staged { lens, data, ..Default::default() }), changed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, Staged> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The elements of every variable.
    pub fn lens(&self) -> Vec<usize> {
        self.lock().lens.clone()
    }

    /// Hands over the gradients of some variables (by index in the push), which the call sends
    /// next; nothing is staged if any of them is refused.
    pub fn stage(&self, grads: Vec<(usize, F32Bytes)>) -> Result<(), StageError> {
        let mut s = self.lock();
        if s.committed || s.abandoned {
            return Err(StageError::Closed);
        }
        let count = s.lens.len();
        for (k, (index, g)) in grads.iter().enumerate() {
            let want = *s.lens.get(*index).ok_or(StageError::UnknownVariable { index: *index, count })?;
            if g.len() != want {
                return Err(StageError::WrongLength { index: *index, want, got: g.len() });
            }
            if s.data[*index].is_some() || grads[..k].iter().any(|(i, _)| i == index) {
                return Err(StageError::StagedTwice { index: *index });
            }
        }
        for (index, g) in grads {
            s.data[index] = Some(g);
            s.order.push(index);
        }
        drop(s);
        self.changed.notify_all();
        Ok(())
    }

    /// Ends the push once every variable was staged: the call sends what is left and ends,
    /// and the task applies the push.
    pub fn commit(&self) -> Result<(), StageError> {
        let mut s = self.lock();
        if s.committed || s.abandoned {
            return Err(StageError::Closed);
        }
        let missing = s.data.iter().filter(|d| d.is_none()).count();
        if missing > 0 {
            return Err(StageError::Incomplete { missing, count: s.lens.len() });
        }
        s.committed = true;
        drop(s);
        self.changed.notify_all();
        Ok(())
    }

    /// Gives the push up: its call is cancelled before its end, so nothing of it is applied
    /// (unless it was committed before, which this does not undo).
    pub fn abandon(&self) {
        let mut s = self.lock();
        if !s.committed {
            s.abandoned = true;
        }
        drop(s);
        self.changed.notify_all();
    }

    /// Whether the push was abandoned.
    pub fn abandoned(&self) -> bool {
        self.lock().abandoned
    }

    /// The `i`-th thing to send, waiting until it is there.
    pub(crate) fn next(&self, i: usize) -> Next {
        let mut s = self.lock();
        loop {
            if s.abandoned {
                return Next::Abandoned;
            }
            if let Some(&index) = s.order.get(i) {
                if let Some(g) = &s.data[index] {
                    return Next::Variable(index, g.clone());
                }
            }
            if s.committed && i >= s.order.len() {
                return Next::End;
            }
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_in_staging_order_and_ends_at_commit() {
        let p = StagedPush::new(vec![2, 1]);
        p.stage(vec![(1, F32Bytes::from_vec(vec![3.0]))]).unwrap();
        assert!(matches!(p.next(0), Next::Variable(1, _)));
        assert_eq!(p.commit(), Err(StageError::Incomplete { missing: 1, count: 2 }));
        assert_eq!(p.stage(vec![(1, F32Bytes::from_vec(vec![3.0]))]), Err(StageError::StagedTwice { index: 1 }));
        assert_eq!(
            p.stage(vec![(0, F32Bytes::from_vec(vec![3.0]))]),
            Err(StageError::WrongLength { index: 0, want: 2, got: 1 })
        );
        assert_eq!(
            p.stage(vec![(2, F32Bytes::from_vec(vec![3.0]))]),
            Err(StageError::UnknownVariable { index: 2, count: 2 })
        );
        p.stage(vec![(0, F32Bytes::from_vec(vec![1.0, 2.0]))]).unwrap();
        assert!(matches!(p.next(1), Next::Variable(0, _)));
        p.commit().unwrap();
        assert!(matches!(p.next(2), Next::End));
        // A retried call takes them again from the start.
        assert!(matches!(p.next(0), Next::Variable(1, _)));
        p.abandon();
        assert!(!p.abandoned(), "a committed push stays committed");
    }

    #[test]
    fn abandon_wakes_a_waiting_sender() {
        let p = std::sync::Arc::new(StagedPush::new(vec![1]));
        let q = p.clone();
        let t = std::thread::spawn(move || matches!(q.next(0), Next::Abandoned));
        p.abandon();
        assert!(t.join().unwrap());
        assert_eq!(p.stage(vec![(0, F32Bytes::from_vec(vec![1.0]))]), Err(StageError::Closed));
    }
}

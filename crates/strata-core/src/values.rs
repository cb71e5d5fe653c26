//! Distributed values: [`PerReplica`] and [`Mirrored`].

use crate::{Error, Result};

/// One value per replica, in replica order: what a step returns on each replica before it is
/// reduced, or what each replica holds of a sync-on-read variable.
#[derive(Clone, Debug, PartialEq)]
pub struct PerReplica<T> {
    values: Vec<T>,
}

impl<T> PerReplica<T> {
    /// Wraps one value per replica. There must be at least one.
    pub fn new(values: Vec<T>) -> Result<Self> {
        if values.is_empty() {
            return Err(Error::ZeroReplicas);
        }
        Ok(Self { values })
    }

    /// The number of replicas.
    pub fn num_replicas(&self) -> usize {
        self.values.len()
    }

    /// The value of replica `replica`.
    pub fn get(&self, replica: usize) -> Option<&T> {
        self.values.get(replica)
    }

    /// All values, in replica order.
    pub fn values(&self) -> &[T] {
        &self.values
    }

    /// Takes the values out.
    pub fn into_values(self) -> Vec<T> {
        self.values
    }

    /// Applies `f` to every replica's value.
    pub fn map<U>(self, f: impl FnMut(T) -> U) -> PerReplica<U> {
        PerReplica { values: self.values.into_iter().map(f).collect() }
    }

    /// Applies a fallible `f` to every replica's value.
    pub fn try_map<U, E>(self, f: impl FnMut(T) -> Result<U, E>) -> Result<PerReplica<U>, E> {
        Ok(PerReplica { values: self.values.into_iter().map(f).collect::<Result<_, E>>()? })
    }
}

/// Identical copies of a value, one per replica. The copies are equal by construction (a
/// mirrored value is only ever produced by a synchronised write or a broadcast).
#[derive(Clone, Debug, PartialEq)]
pub struct Mirrored<T> {
    copies: Vec<T>,
}

impl<T> Mirrored<T> {
    /// Wraps copies that the caller guarantees are identical.
    pub fn from_copies(copies: Vec<T>) -> Result<Self> {
        if copies.is_empty() {
            return Err(Error::ZeroReplicas);
        }
        Ok(Self { copies })
    }

    /// The copy of the first replica (the primary).
    pub fn primary(&self) -> &T {
        &self.copies[0]
    }

    /// The copy of replica `replica`.
    pub fn get(&self, replica: usize) -> Option<&T> {
        self.copies.get(replica)
    }

    /// The number of copies.
    pub fn num_replicas(&self) -> usize {
        self.copies.len()
    }

    /// All copies.
    pub fn copies(&self) -> &[T] {
        &self.copies
    }
}

impl<T: Clone> Mirrored<T> {
    /// `n` copies of `value`.
    pub fn broadcast(value: T, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::ZeroReplicas);
        }
        Ok(Self { copies: vec![value; n] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_replica_keeps_order_and_maps() {
        let p = PerReplica::new(vec![1, 2, 3]).unwrap();
        assert_eq!(p.num_replicas(), 3);
        assert_eq!(p.get(1), Some(&2));
        assert_eq!(p.map(|x| x * 10).into_values(), vec![10, 20, 30]);
        assert!(matches!(PerReplica::<i32>::new(vec![]), Err(Error::ZeroReplicas)));
    }

    #[test]
    fn mirrored_broadcasts() {
        let m = Mirrored::broadcast(7, 4).unwrap();
        assert_eq!(m.copies(), &[7, 7, 7, 7]);
        assert_eq!(*m.primary(), 7);
        assert!(Mirrored::broadcast(1, 0).is_err());
    }
}

//! `MirroredStrategy`: a variable copy per device, synchronous all-reduce every step.

use strata_core::VariablePolicy;

use crate::local::local_strategy;

local_strategy! {
    /// Synchronous data parallelism on one machine (TensorFlow's `MirroredStrategy`): every
    /// replica holds a copy of every variable; gradients are all-reduced each step and every
    /// replica applies the same update, so the copies stay bitwise identical.
    pub struct MirroredStrategy;
    name: "mirrored",
    policy: VariablePolicy::Mirrored,
    new: "One replica per device in `devices`, with the default in-memory all-reduce.",
    with_options: "One replica per device, with a chosen reduction and options.",
}

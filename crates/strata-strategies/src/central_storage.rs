//! `CentralStorageStrategy`: one copy of the variables on the parameter device.

use strata_core::VariablePolicy;

use crate::local::local_strategy;

local_strategy! {
    /// Variables live once, on the parameter device (the CPU); every replica computes with them,
    /// gradients are reduced to the parameter device, and the update is applied there once
    /// (TensorFlow's `CentralStorageStrategy`). Replica 0's thread applies it.
    pub struct CentralStorageStrategy;
    name: "central-storage",
    policy: VariablePolicy::Central { parameter_replica: 0 },
    new: "Compute on `devices`, variables on the CPU.",
    with_options: "Compute on `devices`, with a chosen reduction and options.",
}

//! ParameterServerStrategy and ClusterCoordinator (being written).

pub mod coordinator;

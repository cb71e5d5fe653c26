//! Simulated mode (being written).

use serde::{Deserialize, Serialize};

/// Simulated mode's settings (the `[simulate]` table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// Worker counts.
    pub workers: Vec<usize>,
}

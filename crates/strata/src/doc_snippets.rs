//! Every Rust block of the README and of the user guide (`docs/`), compiled and run as a doc
//! test of this crate (`cargo test --doc -p strata`), so that no snippet drifts from the API.
//!
//! A chapter's blocks hide their imports and setup behind `# ` lines (mdBook hides them too);
//! blocks that would train for long or need a cluster are `no_run`: compiled, not run.

#[doc = include_str!("../../../README.md")]
pub struct Readme;
#[doc = include_str!("../../../docs/introduction.md")]
pub struct Introduction;
#[doc = include_str!("../../../docs/getting-started.md")]
pub struct GettingStarted;
#[doc = include_str!("../../../docs/strategies.md")]
pub struct Strategies;
#[doc = include_str!("../../../docs/your-model.md")]
pub struct YourModel;
#[doc = include_str!("../../../docs/training-loops.md")]
pub struct TrainingLoops;
#[doc = include_str!("../../../docs/multi-worker.md")]
pub struct MultiWorker;
#[doc = include_str!("../../../docs/slow-links.md")]
pub struct SlowLinks;
#[doc = include_str!("../../../docs/elastic.md")]
pub struct Elastic;
#[doc = include_str!("../../../docs/zero.md")]
pub struct Zero;
#[doc = include_str!("../../../docs/parameter-servers.md")]
pub struct ParameterServers;
#[doc = include_str!("../../../docs/gpus.md")]
pub struct Gpus;
#[doc = include_str!("../../../docs/faults.md")]
pub struct Faults;
#[doc = include_str!("../../../docs/comparing.md")]
pub struct Comparing;
#[doc = include_str!("../../../docs/benchmarks.md")]
pub struct Benchmarks;
#[doc = include_str!("../../../docs/performance.md")]
pub struct Performance;
#[doc = include_str!("../../../docs/limits.md")]
pub struct Limits;

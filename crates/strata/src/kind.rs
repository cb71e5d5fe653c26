//! Strategies and optimizers chosen by name at run time: from a command line (`strata train
//! --strategy mirrored --optimizer adamw`) or an experiment file (`strategy = "mirrored"`).
//!
//! Each kind has a fixed kebab-case name ([`StrategyKind::name`]), parses from it
//! ([`std::str::FromStr`]), prints as it, serialises as it, and carries a one-line help text
//! ([`StrategyKind::help`]), so a command line lists the same names and texts the library
//! parses.

use std::fmt;
use std::str::FromStr;

use candle_nn::{AdamW, ParamsAdamW, SGD};
use strata_core::data::{Batch, BatchData};
use strata_core::optim::{FusedAdagrad, FusedAdamW, FusedMomentum, FusedSgd, ParamsAdagrad, ParamsMomentum};
use strata_core::{Replicated, StrategyHandle};
use strata_transport::ps::ServerOptimizer;

use crate::model::Classifier;
use crate::trainer::{FitReport, Task, Trainer};
use crate::Result;

// The error of a name that is none of a kind's: the crate's error module holds it, so that the
// error does not import this module (which imports the error).
pub use crate::error::UnknownName;

/// A kind chosen by name: what a command line needs to list, explain and parse it.
pub trait NamedKind: Copy + Send + Sync + FromStr<Err = UnknownName> + 'static {
    /// Every kind, in the order to list them.
    fn all() -> &'static [Self];
    /// The kebab-case name.
    fn name(self) -> &'static str;
    /// One line saying what it is.
    fn help(self) -> &'static str;
}

macro_rules! named_kinds {
    ($(#[$meta:meta])* $ty:ident, $what:literal { $($(#[$vmeta:meta])* $variant:ident = $name:literal : $help:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $ty {
            $($(#[$vmeta])* $variant,)+
        }

        impl $ty {
            /// Every kind, in the order a command line lists them.
            pub const ALL: &'static [$ty] = &[$($ty::$variant,)+];

            /// The kebab-case name.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }

            /// One line saying what it is.
            pub fn help(self) -> &'static str {
                match self {
                    $($ty::$variant => $help,)+
                }
            }
        }

        impl NamedKind for $ty {
            fn all() -> &'static [Self] {
                Self::ALL
            }
            fn name(self) -> &'static str {
                $ty::name(self)
            }
            fn help(self) -> &'static str {
                $ty::help(self)
            }
        }

        impl FromStr for $ty {
            type Err = UnknownName;

            fn from_str(s: &str) -> std::result::Result<Self, UnknownName> {
                Self::ALL.iter().copied().find(|k| k.name() == s).ok_or_else(|| UnknownName {
                    what: $what,
                    given: s.to_string(),
                    names: Self::ALL.iter().map(|k| k.name()).collect(),
                })
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }
    };
}

named_kinds! {
    /// The distribution strategies.
    StrategyKind, "strategy" {
        /// `OneDeviceStrategy`.
        OneDevice = "one-device": "One device, no reduction.",
        /// `MirroredStrategy`.
        Mirrored = "mirrored": "A variable copy per replica, all-reduce every step.",
        /// `CentralStorageStrategy`.
        CentralStorage = "central-storage": "One variable copy on the parameter device, reduce to it every step.",
        /// `MultiWorkerMirroredStrategy`.
        MultiWorkerMirrored = "multi-worker-mirrored": "A copy on every replica of every worker process; local reduction, then a ring all-reduce across workers. Run one process per task (`strata launch` does it).",
        /// `ParameterServerStrategy`.
        ParameterServer = "parameter-server": "Variables sharded over parameter-server tasks that apply the optimizer; workers pull values and push gradients (async, sync or bounded-staleness). Without `TF_CONFIG`, `strata train` starts the ps and worker processes on loopback and coordinates them.",
    }
}

named_kinds! {
    /// The optimizers. `adamw` and `sgd` are Strata's fused, in-place versions of candle-nn's
    /// optimizers (bitwise the same results, a fraction of the memory passes); `candle-adamw`
    /// and `candle-sgd` are candle-nn's own; `momentum` and `adagrad` are Strata's (the
    /// parameter servers' formulas, on replicas too).
    OptimizerKind, "optimizer" {
        /// [`FusedAdamW`].
        Adamw = "adamw": "AdamW, fused and in place (`strata::optim::FusedAdamW`).",
        /// [`FusedSgd`].
        Sgd = "sgd": "SGD, in place (`strata::optim::FusedSgd`).",
        /// candle-nn's `AdamW`.
        CandleAdamw = "candle-adamw": "candle-nn's `AdamW`.",
        /// candle-nn's `SGD`.
        CandleSgd = "candle-sgd": "candle-nn's `SGD`.",
        /// SGD with momentum, on parameter servers.
        Momentum = "momentum": "SGD with momentum (PyTorch's form; Keras' at a constant learning rate; `strata::optim::FusedMomentum` on replicas).",
        /// Strata's `FusedAdagrad`.
        Adagrad = "adagrad": "Adagrad, Keras' semantics (accumulators from 0.1, epsilon 1e-7; `strata::optim::FusedAdagrad` on replicas).",
    }
}

/// An optimizer's hyperparameters as `strata train` sets them: the learning rate and the
/// momentum, which is SGD-with-momentum's coefficient and AdamW's `beta1` (candle-nn's default,
/// 0.9, unless set). SGD and Adagrad have no momentum.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    /// The learning rate (the peak of a schedule).
    pub lr: f64,
    /// SGD-with-momentum's coefficient and AdamW's `beta1`.
    pub momentum: f64,
}

impl Hyper {
    /// The default momentum (0.9: candle-nn's and PyTorch's AdamW `beta1`).
    pub const DEFAULT_MOMENTUM: f64 = 0.9;

    /// `lr` with the default momentum.
    pub fn lr(lr: f64) -> Self {
        Hyper { lr, momentum: Self::DEFAULT_MOMENTUM }
    }
}

impl OptimizerKind {
    /// Trains `model` under `strategy` with this optimizer at `hyper`'s learning rate (and its
    /// momentum: AdamW's `beta1`).
    pub fn fit<M: Classifier>(
        self,
        hyper: Hyper,
        trainer: &Trainer,
        strategy: &StrategyHandle,
        model: &Replicated<M>,
        train: &Batch,
        test: &Batch,
    ) -> Result<FitReport> {
        self.fit_task(hyper, trainer, strategy, model, &Task::classifier(), train, test)
    }

    /// Trains `model` under `strategy` on `task` with this optimizer at `hyper`'s learning rate
    /// and momentum (checkpointed when the trainer's configuration asks for checkpoints; the
    /// fused optimizers only).
    #[allow(clippy::too_many_arguments)]
    pub fn fit_task<M: Send + Sync, B: BatchData>(
        self,
        hyper: Hyper,
        trainer: &Trainer,
        strategy: &StrategyHandle,
        model: &Replicated<M>,
        task: &Task<'_, M, B>,
        train: &B,
        test: &B,
    ) -> Result<FitReport> {
        let Hyper { lr, momentum } = hyper;
        let adamw = ParamsAdamW { lr, beta1: momentum, ..Default::default() };
        match self {
            OptimizerKind::Adamw => {
                fit_with_state::<FusedAdamW, M, B>(trainer, strategy, model, adamw, task, train, test)
            }
            OptimizerKind::Sgd => fit_with_state::<FusedSgd, M, B>(trainer, strategy, model, lr, task, train, test),
            OptimizerKind::CandleAdamw => fit::<AdamW, M, B>(trainer, strategy, model, adamw, task, train, test),
            OptimizerKind::CandleSgd => fit::<SGD, M, B>(trainer, strategy, model, lr, task, train, test),
            OptimizerKind::Momentum => {
                let p = ParamsMomentum { lr, momentum, nesterov: false };
                fit_with_state::<FusedMomentum, M, B>(trainer, strategy, model, p, task, train, test)
            }
            OptimizerKind::Adagrad => {
                let p = ParamsAdagrad { lr, initial_accumulator: 0.1, eps: 1e-7 };
                fit_with_state::<FusedAdagrad, M, B>(trainer, strategy, model, p, task, train, test)
            }
        }
    }

    /// The optimizer parameter servers run for this kind, at `hyper`'s learning rate and
    /// momentum (the coefficient of [`OptimizerKind::Momentum`], AdamW's `beta1`).
    pub fn server_optimizer(self, hyper: Hyper) -> ServerOptimizer {
        let Hyper { lr, momentum } = hyper;
        match self {
            OptimizerKind::Adamw | OptimizerKind::CandleAdamw => {
                ServerOptimizer::AdamW { lr, beta1: momentum, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
            }
            OptimizerKind::Sgd | OptimizerKind::CandleSgd => ServerOptimizer::Sgd { lr },
            OptimizerKind::Momentum => ServerOptimizer::Momentum { lr, momentum, nesterov: false },
            OptimizerKind::Adagrad => ServerOptimizer::Adagrad { lr, initial_accumulator: 0.1, eps: 1e-7 },
        }
    }
}

fn fit_with_state<O, M: Send + Sync, B: BatchData>(
    trainer: &Trainer,
    strategy: &StrategyHandle,
    model: &Replicated<M>,
    config: O::Config,
    task: &Task<'_, M, B>,
    train: &B,
    test: &B,
) -> Result<FitReport>
where
    O: strata_core::optim::OptimizerMemory + strata_core::checkpoint::OptimizerState + Send,
    O::Config: Clone,
{
    // With the state's hooks whether or not it checkpoints: an elastic job hands the state
    // to a worker that joins.
    let opt = trainer.optimizer::<M, O>(model, config)?;
    trainer.fit_checkpointed(strategy, model, &opt, task, train, test)
}

fn fit<O: strata_core::optim::OptimizerMemory + Send, M: Send + Sync, B: BatchData>(
    trainer: &Trainer,
    strategy: &StrategyHandle,
    model: &Replicated<M>,
    config: O::Config,
    task: &Task<'_, M, B>,
    train: &B,
    test: &B,
) -> Result<FitReport>
where
    O::Config: Clone,
{
    let opt = trainer.optimizer::<M, O>(model, config)?;
    trainer.fit(strategy, model, &opt, task, train, test)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_ones_list_the_known() {
        for k in StrategyKind::ALL {
            assert_eq!(k.name().parse::<StrategyKind>().unwrap(), *k);
            assert_eq!(serde_json::to_string(k).unwrap(), format!("\"{}\"", k.name()));
        }
        for k in OptimizerKind::ALL {
            assert_eq!(k.to_string().parse::<OptimizerKind>().unwrap(), *k);
        }
        let e = "adam".parse::<OptimizerKind>().unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown optimizer \"adam\"; use one of: adamw, sgd, candle-adamw, candle-sgd, momentum, adagrad"
        );
    }

    #[test]
    fn momentum_is_adamw_s_beta1_and_the_momentum_optimizer_s_coefficient() {
        let h = Hyper { lr: 0.01, momentum: 0.4 };
        match OptimizerKind::Adamw.server_optimizer(h) {
            ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
                assert_eq!((lr, beta1, beta2, eps, weight_decay), (0.01, 0.4, 0.999, 1e-8, 0.01))
            }
            o => panic!("{o:?}"),
        }
        match OptimizerKind::Momentum.server_optimizer(h) {
            ServerOptimizer::Momentum { lr, momentum, nesterov } => {
                assert_eq!((lr, momentum, nesterov), (0.01, 0.4, false))
            }
            o => panic!("{o:?}"),
        }
        // The default is candle-nn's beta1, so a default run is the one it always was.
        assert_eq!(Hyper::lr(0.5).momentum, ParamsAdamW::default().beta1);
    }
}

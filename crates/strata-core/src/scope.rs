//! The scope stack: which strategy the current thread is in ([`get_strategy`]), and the
//! default strategy that answers outside any scope.

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use crate::extended::StrategyExtended;
use crate::{Error, Result};

thread_local! {
    static SCOPES: RefCell<Vec<Arc<dyn StrategyExtended>>> = const { RefCell::new(Vec::new()) };
}

/// The strategy whose scope the current thread is in, or the default one-device strategy.
/// Library code can call [`Strategy::reduce`](crate::Strategy::reduce) on what this returns unconditionally.
pub fn get_strategy() -> Arc<dyn StrategyExtended> {
    SCOPES.with(|s| s.borrow().last().cloned()).unwrap_or_else(|| default_strategy().clone())
}

/// Whether the current thread is inside some strategy's scope.
pub fn has_strategy() -> bool {
    SCOPES.with(|s| !s.borrow().is_empty())
}

static DEFAULT: OnceLock<Arc<dyn StrategyExtended>> = OnceLock::new();

/// Registers the default strategy (done by `strata-strategies`; the first registration wins).
pub fn set_default_strategy(s: Arc<dyn StrategyExtended>) {
    let _ = DEFAULT.set(s);
}

fn default_strategy() -> &'static Arc<dyn StrategyExtended> {
    DEFAULT.get_or_init(|| Arc::new(crate::runtime::DefaultStrategy::new()))
}

pub(crate) struct ScopeGuard;

impl ScopeGuard {
    pub(crate) fn enter(ext: &Arc<dyn StrategyExtended>) -> Result<Self> {
        SCOPES.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(outer) = s.last() {
                if outer.id() != ext.id() {
                    return Err(Error::MixedStrategies(format!(
                        "entered the scope of {} {} inside the scope of {} {}; leave one scope before entering another",
                        ext.name(),
                        ext.id(),
                        outer.name(),
                        outer.id()
                    )));
                }
            }
            s.push(ext.clone());
            Ok(ScopeGuard)
        })
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPES.with(|s| {
            s.borrow_mut().pop();
        });
    }
}

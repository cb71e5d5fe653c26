//! Progress bars on a terminal (indicatif): one per run of `strata compare`, and the
//! [`Progress`] the `strata` command hands its trainers.

use std::io::IsTerminal;

use strata::trainer::Progress;

/// A progress bar of `len` steps on standard error, hidden unless `show` and standard error is
/// a terminal.
pub fn bar(show: bool, len: u64) -> indicatif::ProgressBar {
    if !show || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// A trainer's [`Progress`] drawn as a [`bar`]: steps advance it, each epoch's summary is its
/// message, and it is cleared at the end.
#[derive(Debug)]
pub struct Bar(indicatif::ProgressBar);

impl Bar {
    /// A bar shown if `show` and standard error is a terminal.
    pub fn new(show: bool) -> Self {
        Self(bar(show, 0))
    }
}

impl Progress for Bar {
    fn begin(&self, steps: u64) {
        self.0.set_length(steps);
    }
    fn advance(&self, steps: u64) {
        self.0.inc(steps);
    }
    fn epoch(&self, epoch: usize, summary: &str) {
        self.0.set_message(format!("epoch {} {summary}", epoch + 1));
    }
    fn end(&self) {
        self.0.finish_and_clear();
    }
}

//! The plots of `strata compare`, each drawn to `NAME.png` and `NAME.svg` with plotters.
//!
//! - `loss_vs_time`: training loss (moving average) against wall seconds, one line per run;
//! - `loss_vs_bytes`: the same loss against the bytes each worker had sent (log scale), when
//!   some run sent any;
//! - `accuracy_vs_steps`: test accuracy against model updates, one line per run;
//! - for the ctr model, instead: `auc_vs_time` (time to AUC) and `auc_vs_steps`, the test AUC
//!   with the target and the best reachable AUC as dashed lines;
//! - `examples_per_second`: training throughput, one bar per run;
//! - `staleness_histogram`: how stale the pushes of the runs that report staleness were;
//! - when the runs sweep worker counts (names like `ps-async/N=64`): `scaling` (examples/s
//!   against workers, with ideal linear scaling) and `time_to_target_vs_workers`.
//!
//! Failed runs, NaN and infinite values are left out; empty or degenerate inputs give a plot
//! that says what is missing instead of an error. Text is drawn with the bundled DejaVu Sans
//! (plotters' `ab_glyph` backend), so no system font is needed.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{RunResult, RunSummary};
use crate::{Error, Result};
use strata::metrics::RecordKind;

/// Width of every PNG, in pixels.
pub const WIDTH: u32 = 1000;
/// Height of every PNG but the bar chart's (which grows with the number of runs), in pixels.
pub const HEIGHT: u32 = 600;
/// At most this many runs are drawn as separate lines; larger sweeps are cut down to one
/// worker count (and the plot says so).
pub const MAX_SERIES: usize = 10;

/// Series colours (matplotlib's `tab10`), cycled.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

const FONT: &str = "sans-serif";
const GRID_BOLD: RGBColor = RGBColor(205, 205, 205);
const GRID_LIGHT: RGBColor = RGBColor(244, 244, 244);
const NOTE_GREY: RGBColor = RGBColor(90, 90, 90);

/// `c` halfway to white.
fn lighten(c: RGBColor) -> RGBColor {
    let f = |v: u8| ((u16::from(v) + 255) / 2) as u8;
    RGBColor(f(c.0), f(c.1), f(c.2))
}

/// The colour of series `i` (cycles after ten).
pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// One plot written to disk.
#[derive(Clone, Debug, PartialEq)]
pub struct Plot {
    /// File stem (`loss_vs_time`).
    pub name: String,
    /// The title drawn on it.
    pub title: String,
    /// A note drawn under the title (which runs are shown, what is left out), if any.
    pub note: Option<String>,
    /// Whether there was nothing to draw (the plot then only says why).
    pub empty: bool,
    /// The PNG.
    pub png: PathBuf,
    /// The SVG.
    pub svg: PathBuf,
}

/// Registers the bundled font with plotters (once per process).
pub fn register_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, include_bytes!("../assets/DejaVuSans.ttf"))
            .map_err(|_| "the bundled font assets/DejaVuSans.ttf cannot be read".to_string())
    })
    .clone()
    .map_err(Error::Usage)
}

/// Whether the runs sweep worker counts (some run is named like `ps-async/N=64`).
pub fn is_sweep(runs: &[RunResult]) -> bool {
    runs.iter().any(|r| r.name.contains("/N="))
}

/// The part of a sweep run's name before `/N=` (the whole name otherwise).
pub fn sweep_base(name: &str) -> &str {
    name.split_once("/N=").map_or(name, |(base, _)| base)
}

/// Colour index per run: runs of the same sweep base share a colour, so a strategy has the
/// same colour in every plot.
fn color_keys(runs: &[RunResult]) -> Vec<usize> {
    let mut bases: Vec<&str> = Vec::new();
    runs.iter()
        .map(|r| {
            let b = sweep_base(&r.name);
            bases.iter().position(|x| *x == b).unwrap_or_else(|| {
                bases.push(b);
                bases.len() - 1
            })
        })
        .collect()
}

/// Picks at most [`MAX_SERIES`] of `candidates` (indices into `runs`) to draw as lines; the
/// note says what was left out.
fn select(runs: &[RunResult], candidates: Vec<usize>) -> (Vec<usize>, Option<String>) {
    if candidates.len() <= MAX_SERIES {
        return (candidates, None);
    }
    let total = candidates.len();
    if is_sweep(runs) {
        // The worker count present in the most strategies; the largest of those on ties.
        let mut counts: Vec<(usize, usize)> = Vec::new();
        for &i in &candidates {
            match counts.iter_mut().find(|(w, _)| *w == runs[i].workers) {
                Some((_, c)) => *c += 1,
                None => counts.push((runs[i].workers, 1)),
            }
        }
        if let Some(&(n, _)) = counts.iter().max_by_key(|(w, c)| (*c, *w)) {
            let picked: Vec<usize> =
                candidates.iter().copied().filter(|&i| runs[i].workers == n).take(MAX_SERIES).collect();
            let note = format!("showing the {} runs with {n} workers, of {total}", picked.len());
            return (picked, Some(note));
        }
    }
    (candidates.into_iter().take(MAX_SERIES).collect(), Some(format!("showing the first {MAX_SERIES} of {total} runs")))
}

fn simulated_suffix(simulated: bool) -> &'static str {
    if simulated {
        " (simulated)"
    } else {
        ""
    }
}

/// How a series is drawn.
#[derive(Clone, Debug, PartialEq)]
enum Style {
    /// A solid line.
    Line,
    /// A solid line with a marker at every point.
    LineMarkers,
    /// A dashed line.
    Dashed,
    /// A histogram: `(x0, x1, y)` bins, drawn side by side with the chart's other histograms.
    Steps(Vec<(f64, f64, f64)>),
}

/// One line (or histogram) of a chart.
#[derive(Clone, Debug)]
struct Series {
    label: Option<String>,
    color: RGBColor,
    style: Style,
    points: Vec<(f64, f64)>,
}

/// A legend entry.
#[derive(Clone, Debug)]
struct LegendEntry {
    label: String,
    color: RGBColor,
    style: Style,
}

/// A line chart (also used for histograms) with optional log axes and a horizontal marker.
#[derive(Clone, Debug)]
struct LineChart {
    title: String,
    note: Option<String>,
    x_desc: String,
    y_desc: String,
    series: Vec<Series>,
    extra_legend: Vec<LegendEntry>,
    /// Draw x as log2 (axis labels at powers of two).
    x_log2: bool,
    /// Draw x as log10 (axis labels at powers of ten).
    x_log10: bool,
    /// Draw y as log10 when the values span at least this ratio (0: never).
    y_log_ratio: f64,
    /// Integer x labels only.
    x_integer: bool,
    /// Start y at zero.
    y_from_zero: bool,
    /// Upper bound of y (accuracy: 100).
    y_cap: Option<f64>,
    /// Horizontal dashed lines at these y, with their legend labels and colours.
    hlines: Vec<(f64, String, RGBColor)>,
    /// Vertical dotted lines at these x (a run's lost worker), in the run's color.
    vlines: Vec<(f64, RGBColor)>,
    /// What to write when there are no points.
    empty_note: String,
}

impl LineChart {
    fn new(title: String, x_desc: &str, y_desc: &str, empty_note: &str) -> Self {
        Self {
            title,
            note: None,
            x_desc: x_desc.into(),
            y_desc: y_desc.into(),
            series: Vec::new(),
            extra_legend: Vec::new(),
            x_log2: false,
            x_log10: false,
            y_log_ratio: 0.0,
            x_integer: false,
            y_from_zero: false,
            y_cap: None,
            hlines: Vec::new(),
            vlines: Vec::new(),
            empty_note: empty_note.into(),
        }
    }

    fn is_empty(&self) -> bool {
        self.series.iter().all(|s| s.points.is_empty())
    }
}

/// A horizontal bar chart: one labelled bar per entry.
#[derive(Clone, Debug)]
struct BarChart {
    title: String,
    note: Option<String>,
    x_desc: String,
    bars: Vec<(String, f64, RGBColor)>,
    empty_note: String,
}

/// Something that draws itself on any plotters backend.
enum Figure {
    Lines(LineChart),
    Bars(BarChart),
}

impl Figure {
    fn title(&self) -> &str {
        match self {
            Figure::Lines(c) => &c.title,
            Figure::Bars(c) => &c.title,
        }
    }

    fn note(&self) -> Option<&str> {
        match self {
            Figure::Lines(c) => c.note.as_deref(),
            Figure::Bars(c) => c.note.as_deref(),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Figure::Lines(c) => c.is_empty(),
            Figure::Bars(c) => c.bars.is_empty(),
        }
    }

    fn size(&self) -> (u32, u32) {
        match self {
            Figure::Bars(c) => (WIDTH, HEIGHT.max(150 + 30 * c.bars.len() as u32).min(4000)),
            Figure::Lines(_) => (WIDTH, HEIGHT),
        }
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        root.fill(&WHITE).map_err(err)?;
        let body = header(root, self.title(), self.note())?;
        match self {
            Figure::Lines(c) if c.is_empty() => empty_body(&body, &c.empty_note)?,
            Figure::Bars(c) if c.bars.is_empty() => empty_body(&body, &c.empty_note)?,
            Figure::Lines(c) => draw_lines(&body, c)?,
            Figure::Bars(c) => draw_bars(&body, c)?,
        }
        root.present().map_err(err)
    }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Draws the title (and note) and returns the area below them.
fn header<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    note: Option<&str>,
) -> std::result::Result<DrawingArea<DB, Shift>, String> {
    let (w, _) = root.dim_in_pixel();
    let center = Pos::new(HPos::Center, VPos::Top);
    root.draw(&Text::new(title.to_string(), (w as i32 / 2, 12), (FONT, 26).into_font().color(&BLACK).pos(center)))
        .map_err(err)?;
    let mut h = 48;
    if let Some(note) = note {
        root.draw(&Text::new(
            note.to_string(),
            (w as i32 / 2, 46),
            (FONT, 16).into_font().color(&NOTE_GREY).pos(center),
        ))
        .map_err(err)?;
        h += 22;
    }
    Ok(root.split_vertically(h).1)
}

fn empty_body<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, note: &str) -> std::result::Result<(), String> {
    let (w, h) = area.dim_in_pixel();
    area.draw(&Rectangle::new([(40, 20), (w as i32 - 40, h as i32 - 40)], GRID_BOLD.stroke_width(1))).map_err(err)?;
    area.draw(&Text::new(
        note.to_string(),
        (w as i32 / 2, h as i32 / 2 - 10),
        (FONT, 20).into_font().color(&NOTE_GREY).pos(Pos::new(HPos::Center, VPos::Center)),
    ))
    .map_err(err)
}

/// `lo..hi` that contains every value, padded, never empty, never NaN.
fn padded_range(values: impl Iterator<Item = f64>, pad_fraction: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * pad_fraction;
    (lo - pad, hi + pad)
}

/// A short number for axis labels: `0.05`, `12`, `3.5k`, `1.2M`.
pub fn short_number(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        String::new()
    } else if a >= 1e9 {
        trim(format!("{:.1}", v / 1e9)) + "G"
    } else if a >= 1e6 {
        trim(format!("{:.1}", v / 1e6)) + "M"
    } else if a >= 1e4 {
        trim(format!("{:.1}", v / 1e3)) + "k"
    } else if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        trim(format!("{v:.2}"))
    } else if a >= 0.001 {
        trim(format!("{v:.4}"))
    } else {
        format!("{v:.1e}")
    }
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn legend_entries(c: &LineChart) -> Vec<LegendEntry> {
    let mut out: Vec<LegendEntry> = c
        .series
        .iter()
        .filter_map(|s| {
            s.label.as_ref().map(|l| LegendEntry { label: l.clone(), color: s.color, style: s.style.clone() })
        })
        .collect();
    out.extend(c.extra_legend.iter().cloned());
    for (_, label, color) in &c.hlines {
        out.push(LegendEntry { label: label.clone(), color: *color, style: Style::Dashed });
    }
    out
}

/// Width of the legend panel for these labels.
fn legend_width(entries: &[LegendEntry]) -> u32 {
    let chars = entries.iter().map(|e| e.label.chars().count()).max().unwrap_or(0) as u32;
    (chars * 9 + 60).clamp(150, 340)
}

fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[LegendEntry],
) -> std::result::Result<(), String> {
    let (w, _) = area.dim_in_pixel();
    let row = 24;
    let top = 20;
    let height = row * entries.len() as i32 + 12;
    area.draw(&Rectangle::new([(4, top - 8), (w as i32 - 8, top + height - 8)], GRID_BOLD.stroke_width(1)))
        .map_err(err)?;
    let style = (FONT, 15).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, e) in entries.iter().enumerate() {
        let y = top + 6 + row * i as i32;
        match e.style {
            Style::Dashed => {
                for x in (12..40).step_by(10) {
                    area.draw(&PathElement::new(vec![(x, y), (x + 6, y)], e.color.stroke_width(2))).map_err(err)?;
                }
            }
            Style::Steps(_) => {
                area.draw(&Rectangle::new([(12, y - 7), (40, y + 7)], e.color.filled())).map_err(err)?;
            }
            Style::Line | Style::LineMarkers => {
                area.draw(&PathElement::new(vec![(12, y), (40, y)], e.color.stroke_width(3))).map_err(err)?;
                if e.style == Style::LineMarkers {
                    area.draw(&Circle::new((26, y), 4, e.color.filled())).map_err(err)?;
                }
            }
        }
        area.draw(&Text::new(e.label.clone(), (48, y), style.clone())).map_err(err)?;
    }
    Ok(())
}

/// The axes of a line chart: whether each is logarithmic, and their ranges (in log units on a
/// log axis).
struct LineAxes {
    x_log: bool,
    y_log: bool,
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

/// The axes that fit `c`'s points (and its horizontal line): log axes only for positive values,
/// room around the points, and the chart's own wishes (from zero, a cap, whole numbers).
fn line_axes(c: &LineChart) -> LineAxes {
    let xs = || c.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let ys = || {
        c.series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .chain(c.hlines.iter().map(|h| h.0))
            .filter(|v| v.is_finite())
    };
    // Log axes only for positive values.
    let x_log = (c.x_log2 || c.x_log10) && xs().all(|x| x > 0.0);
    let (ymin, ymax) = ys().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
    let y_log = c.y_log_ratio > 0.0 && ymin > 0.0 && ymax / ymin >= c.y_log_ratio;
    let tx = |x: f64| match (x_log, c.x_log10) {
        (true, true) => x.log10(),
        (true, false) => x.log2(),
        _ => x,
    };
    let ty = |y: f64| if y_log { y.log10() } else { y };

    let (mut x0, mut x1) = padded_range(xs().map(tx), 0.02);
    if x_log {
        // A little room beyond the first and last worker count.
        let (a, b) = xs().map(tx).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
        if a.is_finite() && b.is_finite() {
            (x0, x1) = (a - 0.3, b + 0.3);
        }
    } else if xs().all(|x| x >= 0.0) {
        x0 = x0.max(0.0);
    }
    let (mut y0, mut y1) = padded_range(ys().map(ty), 0.05);
    if c.y_from_zero && !y_log {
        y0 = 0.0;
        if y1 <= 0.0 {
            y1 = 1.0;
        }
    }
    if let (Some(cap), false) = (c.y_cap, y_log) {
        y1 = y1.min(cap);
        if y1 <= y0 {
            y1 = y0 + 1.0;
        }
    }
    if c.x_integer && !x_log && x1 - x0 < 4.0 {
        let mid = (x0 + x1) / 2.0;
        (x0, x1) = ((mid - 2.0).max(if x0 >= 0.0 { 0.0 } else { f64::NEG_INFINITY }), mid + 2.0);
        if x1 - x0 < 4.0 {
            x1 = x0 + 4.0;
        }
    }
    LineAxes { x_log, y_log, x0, x1, y0, y1 }
}

fn draw_lines<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, c: &LineChart) -> std::result::Result<(), String> {
    let entries = legend_entries(c);
    let (w, _) = area.dim_in_pixel();
    let (plot_area, legend_area) = if entries.is_empty() {
        (area.clone(), None)
    } else {
        let (a, b) = area.split_horizontally(w - legend_width(&entries));
        (a, Some(b))
    };

    let LineAxes { x_log, y_log, x0, x1, y0, y1 } = line_axes(c);
    let x_base: f64 = if c.x_log10 { 10.0 } else { 2.0 };
    let tx = |x: f64| if x_log { x.log(x_base) } else { x };
    let ty = |y: f64| if y_log { y.log10() } else { y };

    let x_fmt = |v: &f64| -> String {
        if x_log {
            if (v - v.round()).abs() < 1e-6 {
                short_number(x_base.powf(v.round()))
            } else {
                String::new()
            }
        } else if c.x_integer {
            if (v - v.round()).abs() < 1e-6 {
                short_number(v.round())
            } else {
                String::new()
            }
        } else {
            short_number(*v)
        }
    };
    let y_fmt = |v: &f64| -> String {
        if y_log {
            if (v - v.round()).abs() < 1e-6 {
                short_number(10f64.powf(v.round()))
            } else {
                String::new()
            }
        } else {
            short_number(*v)
        }
    };

    let mut chart = ChartBuilder::on(&plot_area)
        .margin_left(12)
        .margin_right(20)
        .margin_top(10)
        .margin_bottom(8)
        .x_label_area_size(56)
        .y_label_area_size(78)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(c.x_desc.clone())
        .y_desc(c.y_desc.clone())
        .x_labels(if x_log { 12 } else { 10 })
        .y_labels(if y_log { 12 } else { 8 })
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .bold_line_style(GRID_BOLD)
        .light_line_style(GRID_LIGHT)
        .draw()
        .map_err(err)?;

    let map = |p: &(f64, f64)| (tx(p.0), ty(p.1));
    let finite = |p: &(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let hist_count = c.series.iter().filter(|s| matches!(s.style, Style::Steps(_))).count();
    let mut hist_slot = 0;
    for s in &c.series {
        let pts: Vec<(f64, f64)> = s.points.iter().map(map).filter(finite).collect();
        match &s.style {
            Style::Line | Style::LineMarkers => {
                chart.draw_series(LineSeries::new(pts.clone(), s.color.stroke_width(2))).map_err(err)?;
                if s.style == Style::LineMarkers || pts.len() == 1 {
                    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, s.color.filled()))).map_err(err)?;
                }
            }
            Style::Dashed => {
                chart.draw_series(DashedLineSeries::new(pts, 8, 6, s.color.stroke_width(2))).map_err(err)?;
            }
            Style::Steps(bins) => {
                // Histograms side by side within each bin, so equal bars do not hide each other.
                let (slot, slots) = (hist_slot, hist_count.max(1));
                hist_slot += 1;
                let base = if y_log { y0 } else { 0f64.max(y0) };
                chart
                    .draw_series(bins.iter().filter(|b| b.2 > 0.0).map(|&(a, b, v)| {
                        let w = (b - a) * 0.9 / slots as f64;
                        let left = a + (b - a) * 0.05 + w * slot as f64;
                        Rectangle::new([(tx(left), base), (tx(left + w), ty(v))], s.color.filled())
                    }))
                    .map_err(err)?;
            }
        }
    }
    for (y, _, color) in &c.hlines {
        let y = ty(*y);
        chart.draw_series(DashedLineSeries::new(vec![(x0, y), (x1, y)], 10, 6, color.stroke_width(1))).map_err(err)?;
    }
    for &(x, color) in &c.vlines {
        let x = tx(x);
        if x.is_finite() {
            chart
                .draw_series(DashedLineSeries::new(vec![(x, y0), (x, y1)], 3, 4, color.stroke_width(2)))
                .map_err(err)?;
        }
    }
    if let Some(legend) = legend_area {
        draw_legend(&legend.margin(10, 0, 0, 8), &entries)?;
    }
    Ok(())
}

fn draw_bars<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, c: &BarChart) -> std::result::Result<(), String> {
    let n = c.bars.len() as i32;
    let longest = c.bars.iter().map(|b| b.0.chars().count()).max().unwrap_or(0) as u32;
    let label_w = (longest * 9 + 24).clamp(80, 360);
    let max = c.bars.iter().map(|b| b.1).filter(|v| v.is_finite()).fold(0f64, f64::max);
    let x1 = if max > 0.0 { max * 1.2 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .margin_left(12)
        .margin_right(30)
        .margin_top(10)
        .margin_bottom(8)
        .x_label_area_size(56)
        .y_label_area_size(label_w)
        .build_cartesian_2d(0f64..x1, (0..(n - 1).max(0)).into_segmented())
        .map_err(err)?;
    // Bar i is drawn in row n-1-i, so the first run is on top.
    let name_of = |v: &SegmentValue<i32>| match v {
        SegmentValue::CenterOf(row) if (0..n).contains(row) => c.bars[(n - 1 - row) as usize].0.clone(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .x_desc(c.x_desc.clone())
        .x_labels(8)
        .y_labels(c.bars.len() + 1)
        .x_label_formatter(&|v| short_number(*v))
        .y_label_formatter(&name_of)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .bold_line_style(GRID_BOLD)
        .light_line_style(GRID_LIGHT)
        .disable_y_mesh()
        .draw()
        .map_err(err)?;
    let margin = if c.bars.len() > 12 { 3 } else { 8 };
    chart
        .draw_series(
            Histogram::horizontal(&chart)
                .style_func(|row, _| {
                    let i = match row {
                        SegmentValue::Exact(r) | SegmentValue::CenterOf(r) => (n - 1 - r).max(0) as usize,
                        SegmentValue::Last => 0,
                    };
                    c.bars.get(i).map_or(BLACK, |b| b.2).filled()
                })
                .margin(margin)
                .data(
                    c.bars.iter().enumerate().map(|(i, b)| (n - 1 - i as i32, if b.1.is_finite() { b.1 } else { 0.0 })),
                ),
        )
        .map_err(err)?;
    let text = (FONT, 14).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
    chart
        .draw_series(c.bars.iter().enumerate().map(|(i, b)| {
            Text::new(
                format!(" {}", group_thousands(b.1)),
                (if b.1.is_finite() { b.1 } else { 0.0 }, SegmentValue::CenterOf(n - 1 - i as i32)),
                text.clone(),
            )
        }))
        .map_err(err)?;
    Ok(())
}

/// An integer with thousands separators: `12,345`.
pub fn group_thousands(v: f64) -> String {
    if !v.is_finite() {
        return "—".into();
    }
    let s = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    if v < 0.0 && s != "0" {
        out.insert(0, '-');
    }
    out
}

/// Draws `fig` to `dir/name.png` and `dir/name.svg`.
fn render(dir: &Path, name: &str, fig: &Figure) -> Result<Plot> {
    register_font()?;
    let png = dir.join(format!("{name}.png"));
    let svg = dir.join(format!("{name}.svg"));
    let size = fig.size();
    let failed =
        |path: &Path, e: String| Error::io(format!("cannot draw {}", path.display()), std::io::Error::other(e));
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        fig.draw(&root).map_err(|e| failed(&png, e))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        fig.draw(&root).map_err(|e| failed(&svg, e))?;
    }
    // The bitmap backend reports some write failures only by leaving no file.
    for p in [&png, &svg] {
        if !p.is_file() {
            return Err(failed(p, "the file was not written".into()));
        }
    }
    Ok(Plot {
        name: name.into(),
        title: fig.title().into(),
        note: fig.note().map(str::to_string),
        empty: fig.is_empty(),
        png,
        svg,
    })
}

/// Trailing moving average over `window` points.
fn moving_average(values: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let window = window.max(1);
    let mut sum = 0.0;
    let mut out = Vec::with_capacity(values.len());
    for (i, &(x, y)) in values.iter().enumerate() {
        sum += y;
        if i >= window {
            sum -= values[i - window].1;
        }
        out.push((x, sum / (i + 1).min(window) as f64));
    }
    out
}

/// At most `max` points, evenly spaced, the last one kept.
fn thin(points: Vec<(f64, f64)>, max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 2 {
        return points;
    }
    let stride = points.len().div_ceil(max);
    let last = *points.last().unwrap_or(&(0.0, 0.0));
    let mut out: Vec<(f64, f64)> = points.into_iter().step_by(stride).collect();
    if out.last() != Some(&last) {
        out.push(last);
    }
    out
}

fn ok_runs(runs: &[RunResult]) -> Vec<usize> {
    (0..runs.len()).filter(|&i| runs[i].error.is_none()).collect()
}

/// Share of a run's steps the loss moving average covers.
pub const LOSS_WINDOW_PERCENT: usize = 5;

/// Training loss (moving average over 5% of each run's steps) against wall seconds.
pub fn loss_vs_time(dir: &Path, runs: &[RunResult], simulated: bool) -> Result<Plot> {
    let keys = color_keys(runs);
    let candidates: Vec<usize> = ok_runs(runs)
        .into_iter()
        .filter(|&i| runs[i].records.iter().any(|r| r.kind == RecordKind::Step && r.loss.is_some_and(f32::is_finite)))
        .collect();
    let (picked, note) = select(runs, candidates);
    let time = if simulated { "wall time (virtual seconds)" } else { "wall time (s)" };
    let mut chart = LineChart::new(
        format!("Training loss against wall time{}", simulated_suffix(simulated)),
        time,
        &format!("training loss (moving average over {LOSS_WINDOW_PERCENT}% of steps)"),
        "no run recorded a finite training loss",
    );
    chart.note = note;
    chart.y_log_ratio = 30.0;
    for i in picked {
        let mut pts: Vec<(f64, f64)> = runs[i]
            .records
            .iter()
            .filter(|r| r.kind == RecordKind::Step && r.wall_s.is_finite())
            .filter_map(|r| r.loss.filter(|l| l.is_finite()).map(|l| (r.wall_s, f64::from(l))))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let window = (pts.len() * LOSS_WINDOW_PERCENT / 100).max(1);
        let pts = thin(moving_average(&pts, window), 1500);
        chart.series.push(Series {
            label: Some(runs[i].name.clone()),
            color: color(keys[i]),
            style: Style::Line,
            points: pts,
        });
    }
    render(dir, "loss_vs_time", &Figure::Lines(chart))
}

/// Training loss (moving average over 5% of each run's steps) against the bytes each worker
/// had sent (the step records' `bytes_sent`, all workers together, summed and divided by the
/// run's workers), on a log scale: what a run paid in traffic for its loss. Steps before a
/// run's first byte are left out (a log axis has no 0); `None` when no run sent a byte
/// (one-device, mirrored on one machine).
pub fn loss_vs_bytes(dir: &Path, runs: &[RunResult], simulated: bool) -> Result<Option<Plot>> {
    let keys = color_keys(runs);
    let sent = |i: usize| runs[i].records.iter().any(|r| r.kind == RecordKind::Step && r.bytes_sent > 0);
    if !(0..runs.len()).any(sent) {
        return Ok(None);
    }
    let candidates: Vec<usize> = ok_runs(runs)
        .into_iter()
        .filter(|&i| sent(i) && runs[i].records.iter().any(|r| r.kind == RecordKind::Step && r.loss.is_some()))
        .collect();
    let (picked, note) = select(runs, candidates);
    let mut chart = LineChart::new(
        format!("Training loss against bytes sent per worker{}", simulated_suffix(simulated)),
        "bytes sent per worker (log scale)",
        &format!("training loss (moving average over {LOSS_WINDOW_PERCENT}% of steps)"),
        "no run recorded a finite training loss after sending",
    );
    chart.note = note;
    chart.x_log10 = true;
    chart.y_log_ratio = 30.0;
    for i in picked {
        let r = &runs[i];
        let workers = r.workers.max(1) as f64;
        let mut steps: Vec<&strata::metrics::MetricRecord> =
            r.records.iter().filter(|x| x.kind == RecordKind::Step).collect();
        steps.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
        let mut total = 0u64;
        let mut pts = Vec::with_capacity(steps.len());
        for s in steps {
            total += s.bytes_sent;
            if let Some(l) = s.loss.filter(|l| l.is_finite()) {
                pts.push((total as f64 / workers, f64::from(l)));
            }
        }
        let window = (pts.len() * LOSS_WINDOW_PERCENT / 100).max(1);
        let pts: Vec<(f64, f64)> = moving_average(&pts, window).into_iter().filter(|p| p.0 > 0.0).collect();
        chart.series.push(Series {
            label: Some(r.name.clone()),
            color: color(keys[i]),
            style: Style::Line,
            points: thin(pts, 1500),
        });
    }
    render(dir, "loss_vs_bytes", &Figure::Lines(chart)).map(Some)
}

/// Test accuracy (percent) against model updates, with the target as a dashed line.
pub fn accuracy_vs_steps(dir: &Path, runs: &[RunResult], target: f32, simulated: bool) -> Result<Plot> {
    let keys = color_keys(runs);
    let candidates: Vec<usize> = ok_runs(runs)
        .into_iter()
        .filter(|&i| {
            runs[i].records.iter().any(|r| r.kind == RecordKind::Eval && r.accuracy.is_some_and(f32::is_finite))
        })
        .collect();
    let (picked, note) = select(runs, candidates);
    let mut chart = LineChart::new(
        format!("Test accuracy against model updates{}", simulated_suffix(simulated)),
        "model updates (optimizer steps applied)",
        "test accuracy (%)",
        "no run recorded an evaluation",
    );
    chart.note = note;
    chart.x_integer = true;
    chart.y_cap = Some(100.5);
    if target.is_finite() && target > 0.0 {
        chart.hlines.push((f64::from(target) * 100.0, format!("target {:.2}%", f64::from(target) * 100.0), BLACK));
    }
    for i in picked {
        let mut pts: Vec<(f64, f64)> = runs[i]
            .records
            .iter()
            .filter(|r| r.kind == RecordKind::Eval)
            .filter_map(|r| r.accuracy.filter(|a| a.is_finite()).map(|a| (r.updates as f64, f64::from(a) * 100.0)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let style = if pts.len() <= 30 { Style::LineMarkers } else { Style::Line };
        chart.series.push(Series {
            label: Some(runs[i].name.clone()),
            color: color(keys[i]),
            style,
            points: thin(pts, 1500),
        });
    }
    render(dir, "accuracy_vs_steps", &Figure::Lines(chart))
}

/// Time to accuracy: test accuracy (percent) against wall seconds, the target as a dashed
/// line and, where `[injection] kill` killed a worker, a dotted line at that moment in the
/// run's color. `None` when no run recorded an accuracy (the transformer's validation loss).
pub fn accuracy_vs_time(dir: &Path, runs: &[RunResult], target: f32, simulated: bool) -> Result<Option<Plot>> {
    let keys = color_keys(runs);
    let has_accuracy =
        |i: usize| runs[i].records.iter().any(|r| r.kind == RecordKind::Eval && r.accuracy.is_some_and(f32::is_finite));
    if !(0..runs.len()).any(has_accuracy) {
        return Ok(None);
    }
    // A run that failed after a kill is drawn too: what a lost worker did to it is the point.
    let candidates: Vec<usize> = (0..runs.len())
        .filter(|&i| has_accuracy(i) && (runs[i].error.is_none() || !runs[i].faults.is_empty()))
        .collect();
    let (picked, note) = select(runs, candidates);
    let time = if simulated { "wall time (virtual seconds)" } else { "wall time (s)" };
    let mut chart = LineChart::new(
        format!("Test accuracy against wall time{}", simulated_suffix(simulated)),
        time,
        "test accuracy (%)",
        "no run recorded an evaluation",
    );
    chart.note = note;
    chart.y_cap = Some(100.5);
    if target.is_finite() && target > 0.0 {
        chart.hlines.push((f64::from(target) * 100.0, format!("target {:.2}%", f64::from(target) * 100.0), BLACK));
    }
    for i in picked {
        let mut pts: Vec<(f64, f64)> = runs[i]
            .records
            .iter()
            .filter(|r| r.kind == RecordKind::Eval && r.wall_s.is_finite())
            .filter_map(|r| r.accuracy.filter(|a| a.is_finite()).map(|a| (r.wall_s, f64::from(a) * 100.0)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let style = if pts.len() <= 30 { Style::LineMarkers } else { Style::Line };
        let c = color(keys[i]);
        chart.series.push(Series { label: Some(runs[i].name.clone()), color: c, style, points: thin(pts, 1500) });
        chart.vlines.extend(runs[i].faults.iter().map(|f| (f.wall_s, c)));
    }
    if !chart.vlines.is_empty() {
        chart.extra_legend.push(LegendEntry { label: "worker killed".into(), color: NOTE_GREY, style: Style::Dashed });
    }
    render(dir, "accuracy_vs_time", &Figure::Lines(chart)).map(Some)
}

/// The dashed lines of the AUC plots: the experiment's target AUC and the best reachable (the
/// planted model's on the same test records), where known.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AucLines {
    /// `target_auc`.
    pub target: Option<f64>,
    /// The runs' `best_test_auc`.
    pub best: Option<f64>,
}

/// Whether run `i` recorded a finite test AUC.
fn has_auc(runs: &[RunResult], i: usize) -> bool {
    runs[i].records.iter().any(|r| r.kind == RecordKind::Eval && r.auc.is_some_and(f32::is_finite))
}

/// The ctr model's test AUC against wall time (`by_time`: time to AUC) or against model
/// updates, the target and the best reachable AUC as dashed lines. `None` when no run recorded
/// an AUC (the other models).
pub fn auc_plot(
    dir: &Path,
    runs: &[RunResult],
    lines: AucLines,
    by_time: bool,
    simulated: bool,
) -> Result<Option<Plot>> {
    if !(0..runs.len()).any(|i| has_auc(runs, i)) {
        return Ok(None);
    }
    let keys = color_keys(runs);
    let candidates: Vec<usize> = ok_runs(runs).into_iter().filter(|&i| has_auc(runs, i)).collect();
    let (picked, note) = select(runs, candidates);
    let (what, x_desc, name) = match (by_time, simulated) {
        (true, true) => ("wall time", "wall time (virtual seconds)", "auc_vs_time"),
        (true, false) => ("wall time", "wall time (s)", "auc_vs_time"),
        (false, _) => ("model updates", "model updates (optimizer steps applied)", "auc_vs_steps"),
    };
    let mut chart = LineChart::new(
        format!("Test AUC against {what}{}", simulated_suffix(simulated)),
        x_desc,
        "test AUC",
        "no run recorded an evaluation",
    );
    chart.note = note;
    chart.x_integer = !by_time;
    chart.y_cap = Some(1.005);
    if let Some(t) = lines.target.filter(|t| t.is_finite()) {
        chart.hlines.push((t, format!("target {t:.4}"), BLACK));
    }
    if let Some(b) = lines.best.filter(|b| b.is_finite()) {
        chart.hlines.push((b, format!("best reachable {b:.4}"), NOTE_GREY));
    }
    for i in picked {
        let mut pts: Vec<(f64, f64)> = runs[i]
            .records
            .iter()
            .filter(|r| r.kind == RecordKind::Eval && r.wall_s.is_finite())
            .filter_map(|r| {
                let x = if by_time { r.wall_s } else { r.updates as f64 };
                r.auc.filter(|a| a.is_finite()).map(|a| (x, f64::from(a)))
            })
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let style = if pts.len() <= 30 { Style::LineMarkers } else { Style::Line };
        chart.series.push(Series {
            label: Some(runs[i].name.clone()),
            color: color(keys[i]),
            style,
            points: thin(pts, 1500),
        });
    }
    render(dir, name, &Figure::Lines(chart)).map(Some)
}

fn check_aligned(runs: &[RunResult], summaries: &[RunSummary]) -> Result<()> {
    if runs.len() != summaries.len() || runs.iter().zip(summaries).any(|(r, s)| r.name != s.name) {
        return Err(Error::Usage("the run summaries do not match the runs".into()));
    }
    Ok(())
}

/// Training examples per second, one bar per run that measured it.
pub fn examples_per_second(dir: &Path, runs: &[RunResult], summaries: &[RunSummary], simulated: bool) -> Result<Plot> {
    check_aligned(runs, summaries)?;
    let keys = color_keys(runs);
    let bars: Vec<(String, f64, RGBColor)> = runs
        .iter()
        .zip(summaries)
        .enumerate()
        .filter(|(_, (r, _))| r.error.is_none())
        .filter_map(|(i, (r, s))| {
            s.examples_per_s.filter(|v| v.is_finite()).map(|v| (r.name.clone(), v, color(keys[i])))
        })
        .collect();
    let left_out = runs.len() - bars.len();
    let chart = BarChart {
        title: format!("Training throughput per run{}", simulated_suffix(simulated)),
        note: (left_out > 0).then(|| format!("{left_out} failed or unmeasured run(s) left out")),
        x_desc: if simulated { "training examples per virtual second" } else { "training examples per second" }.into(),
        bars,
        empty_note: "no run measured its throughput".into(),
    };
    render(dir, "examples_per_second", &Figure::Bars(chart))
}

/// Histogram of the staleness of every step, per run that reports staleness.
pub fn staleness_histogram(dir: &Path, runs: &[RunResult], simulated: bool) -> Result<Plot> {
    let keys = color_keys(runs);
    let values = |i: usize| -> Vec<u64> {
        runs[i].records.iter().filter(|r| r.kind == RecordKind::Step).filter_map(|r| r.staleness).collect()
    };
    let candidates: Vec<usize> = ok_runs(runs).into_iter().filter(|&i| !values(i).is_empty()).collect();
    let (picked, note) = select(runs, candidates);
    let mut chart = LineChart::new(
        format!("Staleness of the pushes{}", simulated_suffix(simulated)),
        "staleness (model updates between a worker's pull and its push)",
        "share of the run's steps (%)",
        "no run reports staleness (only parameter-server runs do)",
    );
    chart.note = note;
    chart.x_integer = true;
    chart.y_from_zero = true;
    chart.y_cap = Some(105.0);
    let max = picked.iter().flat_map(|&i| values(i)).max().unwrap_or(0);
    let width = (max + 1).div_ceil(30).max(1);
    let nbins = (max / width + 1) as usize;
    for i in picked {
        let v = values(i);
        let mut counts = vec![0u64; nbins];
        for s in &v {
            counts[((s / width) as usize).min(nbins - 1)] += 1;
        }
        let bins: Vec<(f64, f64, f64)> = counts
            .iter()
            .enumerate()
            .map(|(b, &c)| {
                let (a, e) = if width == 1 {
                    (b as f64 - 0.5, b as f64 + 0.5)
                } else {
                    ((b as u64 * width) as f64, ((b as u64 + 1) * width) as f64)
                };
                (a, e, c as f64 * 100.0 / v.len() as f64)
            })
            .collect();
        let points = bins.iter().flat_map(|&(a, e, y)| [(a, y), (e, y)]).collect();
        chart.series.push(Series {
            label: Some(runs[i].name.clone()),
            color: color(keys[i]),
            style: Style::Steps(bins),
            points,
        });
    }
    render(dir, "staleness_histogram", &Figure::Lines(chart))
}

/// One strategy of a sweep: base name, colour key, `(workers, run index)` by workers.
type SweepGroup = (String, usize, Vec<(usize, usize)>);

/// The sweep's groups, ok runs only.
fn sweep_groups(runs: &[RunResult]) -> Vec<SweepGroup> {
    let keys = color_keys(runs);
    let mut groups: Vec<SweepGroup> = Vec::new();
    for (i, r) in runs.iter().enumerate().filter(|(_, r)| r.name.contains("/N=") && r.error.is_none()) {
        let base = sweep_base(&r.name);
        match groups.iter_mut().find(|g| g.0 == base) {
            Some(g) => g.2.push((r.workers, i)),
            None => groups.push((base.to_string(), keys[i], vec![(r.workers, i)])),
        }
    }
    for g in &mut groups {
        g.2.sort();
    }
    groups
}

/// Examples per second against worker count (log2), one line per strategy, each with its
/// ideal linear scaling from its 1-worker point (dashed). `None` when the runs are no sweep.
pub fn scaling(dir: &Path, runs: &[RunResult], summaries: &[RunSummary], simulated: bool) -> Result<Option<Plot>> {
    check_aligned(runs, summaries)?;
    if !is_sweep(runs) {
        return Ok(None);
    }
    let mut chart = LineChart::new(
        format!("Throughput against worker count{}", simulated_suffix(simulated)),
        "workers (log scale)",
        if simulated { "training examples per virtual second" } else { "training examples per second" },
        "no run of the sweep measured its throughput",
    );
    chart.x_log2 = true;
    chart.y_log_ratio = 20.0;
    chart.y_from_zero = true;
    let mut ideals: Vec<(usize, (f64, f64), f64)> = Vec::new();
    for (base, key, members) in sweep_groups(runs) {
        let pts: Vec<(f64, f64)> = members
            .iter()
            .filter_map(|&(w, i)| {
                summaries[i].examples_per_s.filter(|v| v.is_finite() && *v > 0.0).map(|v| (w.max(1) as f64, v))
            })
            .collect();
        if pts.is_empty() {
            continue;
        }
        let wmax = pts.iter().map(|p| p.0).fold(pts[0].0, f64::max);
        if wmax > pts[0].0 {
            ideals.push((key, pts[0], wmax));
        }
        chart.series.push(Series { label: Some(base), color: color(key), style: Style::LineMarkers, points: pts });
    }
    // Ideal linear scaling from each strategy's smallest worker count (normally 1): one grey
    // line when they all start from the same point, else one light line per strategy.
    let grey = RGBColor(110, 110, 110);
    let same = ideals.windows(2).all(|w| {
        let ((a, b), (c, d)) = (w[0].1, w[1].1);
        a == c && (b - d).abs() <= 0.01 * b.abs().max(d.abs())
    });
    let wmax = ideals.iter().map(|i| i.2).fold(0.0, f64::max);
    let lines: Vec<(RGBColor, (f64, f64), f64)> = if same {
        ideals.first().map(|i| (grey, i.1, wmax)).into_iter().collect()
    } else {
        ideals.iter().map(|i| (lighten(color(i.0)), i.1, i.2)).collect()
    };
    for (i, (col, (w0, v0), w1)) in lines.iter().enumerate() {
        chart.series.insert(
            i,
            Series { label: None, color: *col, style: Style::Dashed, points: vec![(*w0, *v0), (*w1, v0 * w1 / w0)] },
        );
    }
    if !lines.is_empty() {
        let label = if same { "ideal linear scaling" } else { "ideal linear scaling (light)" };
        chart.extra_legend.push(LegendEntry { label: label.into(), color: grey, style: Style::Dashed });
    }
    render(dir, "scaling", &Figure::Lines(chart)).map(Some)
}

/// Scaling efficiency against worker count (log2), one line per run spec of the sweep (each
/// compression and parameter-server mode its own): examples per second per worker over the
/// spec's own at its smallest worker count (normally 1), so 1 is linear scaling. `None` when
/// the runs are no sweep.
pub fn scaling_efficiency(
    dir: &Path,
    runs: &[RunResult],
    summaries: &[RunSummary],
    simulated: bool,
) -> Result<Option<Plot>> {
    check_aligned(runs, summaries)?;
    if !is_sweep(runs) {
        return Ok(None);
    }
    let mut chart = LineChart::new(
        format!("Scaling efficiency against worker count{}", simulated_suffix(simulated)),
        "workers (log scale)",
        "examples/s per worker over the smallest run's (1 = linear)",
        "no run of the sweep measured its throughput",
    );
    chart.x_log2 = true;
    chart.y_from_zero = true;
    let mut wmax: f64 = 0.0;
    for (base, key, members) in sweep_groups(runs) {
        let pts: Vec<(f64, f64)> = members
            .iter()
            .filter_map(|&(w, i)| {
                summaries[i].examples_per_s.filter(|v| v.is_finite() && *v > 0.0).map(|v| (w.max(1) as f64, v))
            })
            .collect();
        let Some(&(w0, v0)) = pts.first() else { continue };
        let pts: Vec<(f64, f64)> = pts.iter().map(|&(w, v)| (w, (v / w) / (v0 / w0))).collect();
        wmax = pts.iter().map(|p| p.0).fold(wmax, f64::max);
        chart.series.push(Series { label: Some(base), color: color(key), style: Style::LineMarkers, points: pts });
    }
    if wmax > 1.0 {
        let grey = RGBColor(110, 110, 110);
        chart.series.insert(
            0,
            Series { label: None, color: grey, style: Style::Dashed, points: vec![(1.0, 1.0), (wmax, 1.0)] },
        );
        chart.extra_legend.push(LegendEntry { label: "linear scaling".into(), color: grey, style: Style::Dashed });
    }
    render(dir, "scaling_efficiency", &Figure::Lines(chart)).map(Some)
}

/// Time to the target accuracy against worker count (log2), one line per strategy. `None`
/// when the runs are no sweep.
pub fn time_to_target_vs_workers(
    dir: &Path,
    runs: &[RunResult],
    summaries: &[RunSummary],
    target: f32,
    simulated: bool,
) -> Result<Option<Plot>> {
    check_aligned(runs, summaries)?;
    if !is_sweep(runs) {
        return Ok(None);
    }
    let target_text = format!("{:.2}%", f64::from(target) * 100.0);
    let mut chart = LineChart::new(
        format!("Time to {target_text} test accuracy against worker count{}", simulated_suffix(simulated)),
        "workers (log scale)",
        if simulated { "time to target (virtual seconds)" } else { "time to target (s)" },
        &format!("no run of the sweep reached {target_text}"),
    );
    chart.x_log2 = true;
    chart.y_log_ratio = 30.0;
    chart.y_from_zero = true;
    let mut missed = 0;
    for (base, key, members) in sweep_groups(runs) {
        let pts: Vec<(f64, f64)> = members
            .iter()
            .filter_map(|&(w, i)| summaries[i].time_to_target_s.filter(|v| v.is_finite()).map(|v| (w.max(1) as f64, v)))
            .collect();
        missed += members.len() - pts.len();
        if !pts.is_empty() {
            chart.series.push(Series { label: Some(base), color: color(key), style: Style::LineMarkers, points: pts });
        }
    }
    if missed > 0 && !chart.is_empty() {
        chart.note = Some(format!("{missed} run(s) that never reached the target are left out"));
    }
    render(dir, "time_to_target_vs_workers", &Figure::Lines(chart)).map(Some)
}

/// Draws every plot into `dir` (which must exist): the four always (for runs that recorded a
/// test AUC, the ctr model's, its two AUC plots instead of accuracy against updates), the
/// three sweep plots when the runs sweep worker counts. `summaries` is `summarize(runs,
/// target)`; `target` the target accuracy (NaN: none), `auc` the AUC plots' lines.
pub fn draw_all(
    dir: &Path,
    runs: &[RunResult],
    summaries: &[RunSummary],
    target: f32,
    auc: AucLines,
    simulated: bool,
) -> Result<Vec<Plot>> {
    let mut out = vec![loss_vs_time(dir, runs, simulated)?];
    let auc_plots: Vec<Plot> =
        [auc_plot(dir, runs, auc, true, simulated)?, auc_plot(dir, runs, auc, false, simulated)?]
            .into_iter()
            .flatten()
            .collect();
    if auc_plots.is_empty() {
        out.push(accuracy_vs_steps(dir, runs, target, simulated)?);
    }
    out.extend(auc_plots);
    out.push(examples_per_second(dir, runs, summaries, simulated)?);
    out.push(staleness_histogram(dir, runs, simulated)?);
    out.extend(accuracy_vs_time(dir, runs, target, simulated)?);
    out.extend(loss_vs_bytes(dir, runs, simulated)?);
    out.extend(scaling(dir, runs, summaries, simulated)?);
    out.extend(scaling_efficiency(dir, runs, summaries, simulated)?);
    out.extend(time_to_target_vs_workers(dir, runs, summaries, target, simulated)?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_handle_degenerate_values() {
        assert_eq!(padded_range(std::iter::empty(), 0.1), (0.0, 1.0));
        assert_eq!(padded_range([f64::NAN, f64::INFINITY].into_iter(), 0.1), (0.0, 1.0));
        let (a, b) = padded_range([2.0, 2.0].into_iter(), 0.1);
        assert!(a < 2.0 && b > 2.0);
        assert_eq!(group_thousands(1234567.4), "1,234,567");
        assert_eq!(group_thousands(999.0), "999");
        assert_eq!(short_number(12000.0), "12k");
        assert_eq!(short_number(0.5), "0.5");
        assert_eq!(moving_average(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)], 2), vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)]);
        assert_eq!(thin((0..10).map(|i| (i as f64, 0.0)).collect(), 3).last(), Some(&(9.0, 0.0)));
        assert_eq!(sweep_base("ps-async/N=64"), "ps-async");
        assert_eq!(sweep_base("mirrored"), "mirrored");
    }
}

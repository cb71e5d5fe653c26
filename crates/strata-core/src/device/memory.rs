//! Device memory: the [`MemoryPolicy`] a device runs under and the [`MemoryTracker`] that
//! accounts for what Strata allocated on it.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use super::spec::DeviceSpec;
use crate::{Error, Result};

pub use crate::units::format_bytes;
use crate::units::{GIB, KIB, MIB, TIB};

/// The forms a policy takes, quoted in parse errors.
const POLICY_FORMS: &str = "expected grab-all, growth, limit:<size> (e.g. limit:4GiB, limit:512MiB, \
     limit:1073741824) or fraction:<f> with 0 < f <= 1 (e.g. fraction:0.5)";

/// How much of a device's memory Strata may use, like TensorFlow's GPU options.
///
/// Parses from and displays as `grab-all`, `growth`, `limit:<size>` and `fraction:<f>`; sizes
/// are parsed by [`parse_bytes`]. Serde uses the same string form.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum MemoryPolicy {
    /// Reserve the whole device up front (TensorFlow's default).
    #[default]
    GrabAll,
    /// Allocate as needed, up to the whole device (`allow_growth`).
    Growth,
    /// At most this many bytes (`memory_limit`).
    Limit(u64),
    /// At most this fraction, in (0, 1], of the device's memory
    /// (`per_process_gpu_memory_fraction`).
    Fraction(f64),
}

impl MemoryPolicy {
    /// Checks that a limit is positive and a fraction lies in (0, 1].
    pub fn validate(&self) -> Result<()> {
        match *self {
            MemoryPolicy::Limit(0) => Err(Error::InvalidMemoryConfig(
                "a memory limit of 0 bytes leaves nothing to allocate; use a positive limit such as \
                 limit:4GiB, or growth"
                    .to_string(),
            )),
            MemoryPolicy::Fraction(f) if !(f > 0.0 && f <= 1.0) => Err(Error::InvalidMemoryConfig(format!(
                "memory fraction {f} is out of range; use a value in (0, 1], e.g. fraction:0.5"
            ))),
            _ => Ok(()),
        }
    }

    /// The most bytes Strata may hold on a device of `device_total` bytes (`None`: unknown),
    /// or `None` for no limit (the whole device when its size is unknown).
    ///
    /// Fails when the policy is not valid, when a limit exceeds the device, or when a fraction
    /// is asked of a device whose size is unknown.
    pub fn budget(&self, device_total: Option<u64>) -> Result<Option<u64>> {
        self.validate()?;
        match *self {
            MemoryPolicy::GrabAll | MemoryPolicy::Growth => Ok(device_total),
            MemoryPolicy::Limit(limit) => match device_total {
                Some(total) if limit > total => Err(Error::InvalidMemoryConfig(format!(
                    "memory limit {} exceeds the device's {}; use a limit of at most {}, or a fraction",
                    format_bytes(limit),
                    format_bytes(total),
                    exact_bytes(total)
                ))),
                _ => Ok(Some(limit)),
            },
            MemoryPolicy::Fraction(f) => match device_total {
                // The product is at most `total`, so the cast cannot overflow.
                Some(total) => Ok(Some((total as f64 * f).floor() as u64)),
                None => Err(Error::InvalidMemoryConfig(format!(
                    "{self} needs the device's total memory, which is unknown; use limit:<size> instead"
                ))),
            },
        }
    }
}

impl fmt::Display for MemoryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryPolicy::GrabAll => f.write_str("grab-all"),
            MemoryPolicy::Growth => f.write_str("growth"),
            MemoryPolicy::Limit(bytes) => write!(f, "limit:{}", exact_bytes(*bytes)),
            MemoryPolicy::Fraction(x) => write!(f, "fraction:{x}"),
        }
    }
}

impl FromStr for MemoryPolicy {
    type Err = Error;

    /// Parses `grab-all` (or `grab_all`), `growth`, `limit:<size>`, `fraction:<f>`; keys in
    /// any case, whitespace around the parts ignored. The result is validated.
    fn from_str(s: &str) -> Result<Self> {
        let text = s.trim();
        let (key, value) = match text.split_once(':') {
            Some((k, v)) => (k.trim().to_ascii_lowercase(), Some(v.trim())),
            None => (text.to_ascii_lowercase(), None),
        };
        let bad = |what: String| Error::InvalidMemoryConfig(format!("bad memory policy {s:?}: {what}"));
        let policy = match (key.as_str(), value) {
            ("grab-all" | "grab_all", None) => MemoryPolicy::GrabAll,
            ("growth", None) => MemoryPolicy::Growth,
            ("limit", Some(size)) => MemoryPolicy::Limit(parse_bytes(size)?),
            ("fraction", Some(x)) => {
                MemoryPolicy::Fraction(x.parse().map_err(|_| bad(format!("{x:?} is not a number; {POLICY_FORMS}")))?)
            }
            ("limit" | "fraction", None) => return Err(bad(format!("{key} needs a value; {POLICY_FORMS}"))),
            ("grab-all" | "grab_all" | "growth", Some(_)) => {
                return Err(bad(format!("{key} takes no value; {POLICY_FORMS}")))
            }
            _ => return Err(bad(POLICY_FORMS.to_string())),
        };
        policy.validate()?;
        Ok(policy)
    }
}

impl serde::Serialize for MemoryPolicy {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for MemoryPolicy {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Parses a byte size: a whole number of bytes (`1073741824`), or a number (decimals allowed)
/// followed by a unit, in any case and with optional space: `B`; binary `KiB`, `MiB`, `GiB`,
/// `TiB` (also `K`, `M`, `G`, `T`); decimal `KB`, `MB`, `GB`, `TB`. Fractions of a byte are
/// dropped: `1.5KiB` is 1536 bytes.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let text = s.trim();
    let bad = |why: &str| {
        Error::InvalidMemoryConfig(format!(
            "bad size {s:?}: {why}; expected bytes or a number with a unit, such as 1073741824, \
             512MiB or 4GiB"
        ))
    };
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = (&text[..split], text[split..].trim());
    if number.is_empty() {
        return Err(bad("no number"));
    }
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => KIB,
        "m" | "mi" | "mib" => MIB,
        "g" | "gi" | "gib" => GIB,
        "t" | "ti" | "tib" => TIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad("unknown unit")),
    };
    if number.bytes().all(|b| b.is_ascii_digit()) {
        let n: u64 = number.parse().map_err(|_| bad("too large"))?;
        return n.checked_mul(multiplier).ok_or_else(|| bad("too large"));
    }
    let x: f64 = number.parse().map_err(|_| bad("not a number"))?;
    if multiplier == 1 {
        return Err(bad("a number of bytes must be whole"));
    }
    let bytes = (x * multiplier as f64).floor();
    if bytes >= u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(bytes as u64)
}

/// A size that [`parse_bytes`] reads back exactly: the largest binary unit dividing it
/// (`4GiB`, `1536KiB`), else plain bytes.
fn exact_bytes(bytes: u64) -> String {
    let units = [(TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")];
    for (size, name) in units {
        if bytes >= size && (bytes / size) * size == bytes {
            return format!("{}{name}", bytes / size);
        }
    }
    bytes.to_string()
}

/// What Strata holds on a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryInfo {
    /// Bytes allocated now.
    pub current: u64,
    /// The most bytes allocated at once since the tracker started or the last
    /// [`MemoryTracker::reset_peak`].
    pub peak: u64,
}

/// Unlimited budget.
const NO_BUDGET: u64 = u64::MAX;

/// One device's counters.
#[derive(Debug)]
struct DeviceMemory {
    current: AtomicU64,
    peak: AtomicU64,
    /// The budget in bytes, [`NO_BUDGET`] for none.
    budget: AtomicU64,
    /// The policy and the device's total memory (when known) the budget derives from.
    config: Mutex<(MemoryPolicy, Option<u64>)>,
}

impl DeviceMemory {
    fn new() -> Self {
        DeviceMemory {
            current: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            budget: AtomicU64::new(NO_BUDGET),
            config: Mutex::new((MemoryPolicy::default(), None)),
        }
    }

    fn config(&self) -> std::sync::MutexGuard<'_, (MemoryPolicy, Option<u64>)> {
        self.config.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Accounts, per device, for the memory Strata allocated, and enforces each device's
/// [`MemoryPolicy`]. Thread-safe: counters are atomics; devices are keyed by their exact spec
/// (use the same spelling, e.g. `/device:GPU:0`, throughout).
///
/// A device starts with [`MemoryPolicy::GrabAll`] and an unknown total, hence no budget.
#[derive(Debug, Default)]
pub struct MemoryTracker {
    devices: RwLock<HashMap<DeviceSpec, Arc<DeviceMemory>>>,
}

impl MemoryTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide tracker.
    pub fn global() -> &'static MemoryTracker {
        static GLOBAL: OnceLock<MemoryTracker> = OnceLock::new();
        GLOBAL.get_or_init(MemoryTracker::new)
    }

    fn get(&self, device: &DeviceSpec) -> Option<Arc<DeviceMemory>> {
        self.devices.read().unwrap_or_else(|e| e.into_inner()).get(device).cloned()
    }

    fn entry(&self, device: &DeviceSpec) -> Arc<DeviceMemory> {
        if let Some(entry) = self.get(device) {
            return entry;
        }
        let mut devices = self.devices.write().unwrap_or_else(|e| e.into_inner());
        devices.entry(device.clone()).or_insert_with(|| Arc::new(DeviceMemory::new())).clone()
    }

    /// Recomputes the budget of `entry` for `policy` and `total`, storing all three, or
    /// changes nothing when the budget cannot be computed.
    fn configure(entry: &DeviceMemory, policy: MemoryPolicy, total: Option<u64>) -> Result<()> {
        let mut config = entry.config();
        let budget = policy.budget(total)?;
        *config = (policy, total);
        entry.budget.store(budget.unwrap_or(NO_BUDGET), Ordering::Release);
        Ok(())
    }

    /// Sets the policy of `device`; its budget derives from the device's total memory, if
    /// recorded with [`MemoryTracker::set_device_total`] (record it first for `fraction:`).
    /// Allocations already made are kept even when they exceed the new budget.
    pub fn set_policy(&self, device: &DeviceSpec, policy: MemoryPolicy) -> Result<()> {
        let entry = self.entry(device);
        let total = entry.config().1;
        Self::configure(&entry, policy, total)
            .map_err(|e| Error::InvalidMemoryConfig(format!("{device}: {}", strip_prefix(&e))))
    }

    /// Records the total memory of `device` (`None`: unknown) and recomputes its budget.
    pub fn set_device_total(&self, device: &DeviceSpec, total: Option<u64>) -> Result<()> {
        let entry = self.entry(device);
        let policy = entry.config().0;
        Self::configure(&entry, policy, total)
            .map_err(|e| Error::InvalidMemoryConfig(format!("{device}: {}", strip_prefix(&e))))
    }

    /// The policy of `device`.
    pub fn policy(&self, device: &DeviceSpec) -> MemoryPolicy {
        self.get(device).map(|e| e.config().0).unwrap_or_default()
    }

    /// The budget of `device` in bytes, `None` for unlimited.
    pub fn budget(&self, device: &DeviceSpec) -> Option<u64> {
        let budget = self.get(device).map_or(NO_BUDGET, |e| e.budget.load(Ordering::Acquire));
        (budget != NO_BUDGET).then_some(budget)
    }

    /// Records an allocation of `bytes` on `device`, or refuses it (changing nothing) when it
    /// would take the device past its budget.
    pub fn allocate(&self, device: &DeviceSpec, bytes: u64) -> Result<()> {
        let entry = self.entry(device);
        let budget = entry.budget.load(Ordering::Acquire);
        let mut current = entry.current.load(Ordering::Relaxed);
        loop {
            let new = match current.checked_add(bytes) {
                Some(new) if new <= budget => new,
                _ => {
                    let policy = entry.config().0;
                    return Err(Error::InvalidMemoryConfig(format!(
                        "cannot allocate {} on {device}: {} is already allocated and the budget is {} \
                         under policy {policy}; free memory, allocate less, or raise the budget \
                         (a larger limit or fraction)",
                        format_bytes(bytes),
                        format_bytes(current),
                        if budget == NO_BUDGET { "unlimited".to_string() } else { format_bytes(budget) },
                    )));
                }
            };
            match entry.current.compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    entry.peak.fetch_max(new, Ordering::AcqRel);
                    return Ok(());
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Records that `bytes` were freed on `device`. Freeing more than is allocated is a bug
    /// of the caller: it is logged and the count stops at 0.
    pub fn free(&self, device: &DeviceSpec, bytes: u64) {
        let Some(entry) = self.get(device) else {
            if bytes > 0 {
                tracing::warn!("freeing {bytes} bytes on {device}, where nothing was allocated");
            }
            return;
        };
        let result = entry
            .current
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |current| Some(current.saturating_sub(bytes)));
        if let Ok(previous) = result {
            if previous < bytes {
                tracing::warn!("freeing {bytes} bytes on {device}, where only {previous} were allocated");
            }
        }
    }

    /// Current and peak bytes of `device` (zeros for a device never used).
    pub fn memory_info(&self, device: &DeviceSpec) -> MemoryInfo {
        self.get(device).map_or_else(MemoryInfo::default, |e| MemoryInfo {
            current: e.current.load(Ordering::Acquire),
            peak: e.peak.load(Ordering::Acquire),
        })
    }

    /// Sets the peak of `device` to what is allocated now.
    pub fn reset_peak(&self, device: &DeviceSpec) {
        if let Some(e) = self.get(device) {
            e.peak.store(e.current.load(Ordering::Acquire), Ordering::Release);
            // An allocation racing with the store may have raised `current` past it.
            e.peak.fetch_max(e.current.load(Ordering::Acquire), Ordering::AcqRel);
        }
    }

    /// The devices the tracker has seen, sorted by their spec's string form.
    pub fn devices(&self) -> Vec<DeviceSpec> {
        let mut devices: Vec<DeviceSpec> =
            self.devices.read().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect();
        devices.sort_by_key(|d| d.to_string());
        devices
    }
}

/// The message of an `InvalidMemoryConfig` without its "invalid memory configuration: ".
fn strip_prefix(e: &Error) -> String {
    match e {
        Error::InvalidMemoryConfig(msg) => msg.clone(),
        other => other.to_string(),
    }
}

/// Current and peak bytes Strata holds on `device`, from [`MemoryTracker::global`]
/// (like `tf.config.experimental.get_memory_info`).
pub fn memory_info(device: &DeviceSpec) -> MemoryInfo {
    MemoryTracker::global().memory_info(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    fn policy(s: &str) -> MemoryPolicy {
        s.parse().unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    fn memory_err(e: Error) -> String {
        assert!(matches!(e, Error::InvalidMemoryConfig(_)), "{e:?}");
        let msg = e.to_string();
        assert!(!msg.ends_with('.'), "{msg}");
        msg
    }

    #[test]
    fn parses_policies() {
        assert_eq!(policy("grab-all"), MemoryPolicy::GrabAll);
        assert_eq!(policy("GRAB_ALL"), MemoryPolicy::GrabAll);
        assert_eq!(policy(" growth "), MemoryPolicy::Growth);
        assert_eq!(policy("limit:4GiB"), MemoryPolicy::Limit(4 * GIB));
        assert_eq!(policy("limit:1073741824"), MemoryPolicy::Limit(GIB));
        assert_eq!(policy("limit:512MiB"), MemoryPolicy::Limit(512 * MIB));
        assert_eq!(policy("Limit: 2 gb"), MemoryPolicy::Limit(2_000_000_000));
        assert_eq!(policy("limit:1.5GiB"), MemoryPolicy::Limit(3 * GIB / 2));
        assert_eq!(policy("fraction:0.5"), MemoryPolicy::Fraction(0.5));
        assert_eq!(policy("fraction:1"), MemoryPolicy::Fraction(1.0));
    }

    #[test]
    fn rejects_bad_policies_with_hints() {
        let cases: &[(&str, &str)] = &[
            ("", "expected grab-all"),
            ("all", "expected grab-all"),
            ("limit", "needs a value"),
            ("fraction", "needs a value"),
            ("growth:1", "takes no value"),
            ("limit:0", "limit:4GiB"),
            ("limit:0GiB", "positive limit"),
            ("limit:4XB", "unknown unit"),
            ("limit:GiB", "no number"),
            ("limit:1.5", "whole"),
            ("limit:-1", "no number"),
            ("limit:99999999999999999999", "too large"),
            ("limit:99999999999TiB", "too large"),
            ("fraction:0", "(0, 1]"),
            ("fraction:1.5", "(0, 1]"),
            ("fraction:-0.5", "(0, 1]"),
            ("fraction:nan", "(0, 1]"),
            ("fraction:inf", "(0, 1]"),
            ("fraction:half", "not a number"),
        ];
        for (input, needle) in cases {
            let msg = memory_err(input.parse::<MemoryPolicy>().unwrap_err());
            assert!(msg.contains(needle), "{input:?}: {msg:?} lacks {needle:?}");
        }
        assert!(MemoryPolicy::Limit(0).validate().is_err());
        assert!(MemoryPolicy::Fraction(0.0).validate().is_err());
        assert!(MemoryPolicy::Fraction(1.0).validate().is_ok());
    }

    #[test]
    fn display_round_trips() {
        let policies = [
            MemoryPolicy::GrabAll,
            MemoryPolicy::Growth,
            MemoryPolicy::Limit(4 * GIB),
            MemoryPolicy::Limit(512 * MIB),
            MemoryPolicy::Limit(1536 * KIB),
            MemoryPolicy::Limit(1_000_000_001),
            MemoryPolicy::Limit(3 * TIB),
            MemoryPolicy::Fraction(0.5),
            MemoryPolicy::Fraction(1.0),
            MemoryPolicy::Fraction(0.1 + 0.2),
        ];
        for p in policies {
            assert_eq!(policy(&p.to_string()), p, "{p}");
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_json::from_str::<MemoryPolicy>(&json).unwrap(), p);
        }
        assert_eq!(MemoryPolicy::Limit(4 * GIB).to_string(), "limit:4GiB");
        assert_eq!(MemoryPolicy::Limit(1000).to_string(), "limit:1000");
        assert_eq!(MemoryPolicy::Fraction(0.5).to_string(), "fraction:0.5");
        assert_eq!(MemoryPolicy::default().to_string(), "grab-all");
        assert!(serde_json::from_str::<MemoryPolicy>("\"fraction:2\"").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("0").unwrap(), 0);
        assert_eq!(parse_bytes("12 B").unwrap(), 12);
        assert_eq!(parse_bytes("1k").unwrap(), 1024);
        assert_eq!(parse_bytes("1KB").unwrap(), 1000);
        assert_eq!(parse_bytes("2TiB").unwrap(), 2 * TIB);
        assert_eq!(parse_bytes("0.5 MiB").unwrap(), MIB / 2);
        assert!(parse_bytes("1..5GiB").is_err());
        assert!(parse_bytes("").is_err());
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(80 * GIB), "80.0 GiB");
        assert_eq!(exact_bytes(0), "0");
        assert_eq!(exact_bytes(GIB + MIB), "1025MiB");
    }

    #[test]
    fn budgets() {
        let total = Some(8 * GIB);
        assert_eq!(MemoryPolicy::GrabAll.budget(total).unwrap(), total);
        assert_eq!(MemoryPolicy::GrabAll.budget(None).unwrap(), None);
        assert_eq!(MemoryPolicy::Growth.budget(total).unwrap(), total);
        assert_eq!(MemoryPolicy::Limit(GIB).budget(total).unwrap(), Some(GIB));
        assert_eq!(MemoryPolicy::Limit(GIB).budget(None).unwrap(), Some(GIB));
        assert_eq!(MemoryPolicy::Limit(8 * GIB).budget(total).unwrap(), Some(8 * GIB));
        let msg = memory_err(MemoryPolicy::Limit(9 * GIB).budget(total).unwrap_err());
        assert!(msg.contains("exceeds the device's 8.0 GiB") && msg.contains("at most 8GiB"), "{msg}");
        assert_eq!(MemoryPolicy::Fraction(0.5).budget(total).unwrap(), Some(4 * GIB));
        assert_eq!(MemoryPolicy::Fraction(1.0).budget(Some(u64::MAX)).unwrap(), Some(u64::MAX));
        assert_eq!(MemoryPolicy::Fraction(0.3).budget(Some(10)).unwrap(), Some(3));
        let msg = memory_err(MemoryPolicy::Fraction(0.5).budget(None).unwrap_err());
        assert!(msg.contains("fraction:0.5 needs the device's total memory") && msg.contains("limit:"));
        assert!(MemoryPolicy::Fraction(2.0).budget(total).is_err());
        assert!(MemoryPolicy::Limit(0).budget(None).is_err());
    }

    #[test]
    fn enforces_the_limit() {
        let tracker = MemoryTracker::new();
        let gpu = DeviceSpec::gpu(0);
        assert_eq!(tracker.budget(&gpu), None);
        tracker.set_policy(&gpu, MemoryPolicy::Limit(100)).unwrap();
        assert_eq!(tracker.policy(&gpu), MemoryPolicy::Limit(100));
        assert_eq!(tracker.budget(&gpu), Some(100));
        tracker.allocate(&gpu, 60).unwrap();
        tracker.allocate(&gpu, 40).unwrap();
        let msg = memory_err(tracker.allocate(&gpu, 1).unwrap_err());
        for needle in ["/device:GPU:0", "1 B", "100 B", "limit:100", "raise the budget"] {
            assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
        }
        assert_eq!(tracker.memory_info(&gpu), MemoryInfo { current: 100, peak: 100 });
        tracker.free(&gpu, 50);
        tracker.allocate(&gpu, 50).unwrap();
        assert!(tracker.allocate(&gpu, u64::MAX).is_err(), "overflow is refused");
        // Other devices are independent and unlimited by default.
        tracker.allocate(&DeviceSpec::gpu(1), u64::MAX - 1).unwrap();
        assert_eq!(tracker.memory_info(&gpu).current, 100);
    }

    #[test]
    fn fraction_needs_the_device_total() {
        let tracker = MemoryTracker::new();
        let gpu = DeviceSpec::gpu(0);
        let msg = memory_err(tracker.set_policy(&gpu, MemoryPolicy::Fraction(0.5)).unwrap_err());
        assert!(msg.contains("/device:GPU:0") && msg.contains("unknown"), "{msg}");
        assert_eq!(tracker.policy(&gpu), MemoryPolicy::GrabAll, "a failed set changes nothing");
        tracker.set_device_total(&gpu, Some(1000)).unwrap();
        assert_eq!(tracker.budget(&gpu), Some(1000));
        tracker.set_policy(&gpu, MemoryPolicy::Fraction(0.25)).unwrap();
        assert_eq!(tracker.budget(&gpu), Some(250));
        assert!(tracker.allocate(&gpu, 251).is_err());
        tracker.allocate(&gpu, 250).unwrap();
        assert!(tracker.set_device_total(&gpu, None).is_err());
        assert_eq!(tracker.budget(&gpu), Some(250));
        tracker.set_device_total(&gpu, Some(2000)).unwrap();
        assert_eq!(tracker.budget(&gpu), Some(500));
        tracker.set_policy(&gpu, MemoryPolicy::Limit(10)).unwrap();
        assert_eq!(tracker.memory_info(&gpu).current, 250, "kept past a lowered budget");
        assert!(tracker.allocate(&gpu, 1).is_err());
        assert!(tracker.set_policy(&gpu, MemoryPolicy::Limit(3000)).is_err());
    }

    #[test]
    fn peak_and_reset() {
        let tracker = MemoryTracker::new();
        let cpu = DeviceSpec::cpu(0);
        assert_eq!(tracker.memory_info(&cpu), MemoryInfo::default());
        tracker.reset_peak(&cpu);
        tracker.allocate(&cpu, 10).unwrap();
        tracker.allocate(&cpu, 20).unwrap();
        tracker.free(&cpu, 25);
        assert_eq!(tracker.memory_info(&cpu), MemoryInfo { current: 5, peak: 30 });
        tracker.reset_peak(&cpu);
        assert_eq!(tracker.memory_info(&cpu), MemoryInfo { current: 5, peak: 5 });
        tracker.free(&cpu, 100);
        assert_eq!(tracker.memory_info(&cpu).current, 0, "over-freeing stops at 0");
        tracker.free(&DeviceSpec::cpu(9), 1);
        assert_eq!(tracker.devices(), vec![DeviceSpec::cpu(0)]);
    }

    #[test]
    fn peak_across_threads() {
        let tracker = MemoryTracker::new();
        let gpu = DeviceSpec::gpu(0);
        let threads = 8;
        let barrier = Barrier::new(threads);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    tracker.allocate(&gpu, 1000).unwrap();
                    barrier.wait();
                    tracker.free(&gpu, 1000);
                });
            }
        });
        assert_eq!(tracker.memory_info(&gpu), MemoryInfo { current: 0, peak: 8000 });
    }

    #[test]
    fn budget_holds_under_contention() {
        let tracker = MemoryTracker::new();
        let gpu = DeviceSpec::gpu(3);
        tracker.set_policy(&gpu, MemoryPolicy::Limit(1000)).unwrap();
        let refused = AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (tracker, gpu, refused) = (&tracker, &gpu, &refused);
                s.spawn(move || {
                    for i in 0..2000u64 {
                        let bytes = 1 + (t * 31 + i * 17) % 200;
                        match tracker.allocate(gpu, bytes) {
                            Ok(()) => {
                                assert!(tracker.memory_info(gpu).peak <= 1000);
                                tracker.free(gpu, bytes);
                            }
                            Err(_) => {
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        let info = tracker.memory_info(&gpu);
        assert_eq!(info.current, 0);
        assert!(info.peak <= 1000 && info.peak >= 200, "{info:?}");
    }

    #[test]
    fn global_tracker() {
        // A spec no other test uses: the global tracker is shared.
        let device = DeviceSpec::gpu(0).with_job("memory-global-test");
        let before = memory_info(&device);
        MemoryTracker::global().allocate(&device, 7).unwrap();
        assert_eq!(memory_info(&device).current, before.current + 7);
        MemoryTracker::global().free(&device, 7);
        assert_eq!(memory_info(&device).current, before.current);
        assert!(std::ptr::eq(MemoryTracker::global(), MemoryTracker::global()));
    }
}

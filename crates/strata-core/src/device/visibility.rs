//! `CUDA_VISIBLE_DEVICES`: which physical GPUs a process sees, and in what order.
//!
//! [`resolve_visible_devices`] applies CUDA's rules (listed in its docs) as a pure function of
//! the variable's value and the physical devices.

use std::fmt;

use super::physical::PhysicalDevice;
use crate::{Error, Result};

/// The environment variable CUDA reads.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// The visible devices of one type, in logical order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct VisibleDevices {
    /// Physical indices; the position is the logical index.
    pub order: Vec<u32>,
}

impl VisibleDevices {
    /// Devices in the given order (position = logical index). No check is made here;
    /// [`DeviceRegistry::set_visible_order`](super::DeviceRegistry::set_visible_order) checks
    /// against the physical devices.
    pub fn new(order: Vec<u32>) -> Self {
        VisibleDevices { order }
    }

    /// Every device of `physical`, in index order.
    pub fn all(physical: &[PhysicalDevice]) -> Self {
        let mut order: Vec<u32> = physical.iter().map(|d| d.index).collect();
        order.sort_unstable();
        order.dedup();
        VisibleDevices { order }
    }

    /// No device.
    pub fn none() -> Self {
        VisibleDevices::default()
    }

    /// The physical index of logical device `logical`.
    pub fn physical_of(&self, logical: u32) -> Option<u32> {
        self.order.get(usize::try_from(logical).ok()?).copied()
    }

    /// The logical index of physical device `physical`, if it is visible.
    pub fn logical_of(&self, physical: u32) -> Option<u32> {
        let pos = self.order.iter().position(|&p| p == physical)?;
        u32::try_from(pos).ok()
    }

    /// How many devices are visible.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether no device is visible.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether physical device `physical` is visible.
    pub fn contains(&self, physical: u32) -> bool {
        self.order.contains(&physical)
    }

    /// The physical indices in logical order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.order.iter().copied()
    }
}

impl fmt::Display for VisibleDevices {
    /// The list as `CUDA_VISIBLE_DEVICES` would spell it (`2,0,1`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.order.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// Where and why a visible-device list stopped early.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoppedAt {
    /// 0-based position of the entry in the list.
    pub position: usize,
    /// The entry, trimmed.
    pub entry: String,
    /// Why it is not valid.
    pub reason: String,
}

impl fmt::Display for StoppedAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "entry {} ({:?}) {}; it and the entries after it are ignored",
            self.position + 1,
            self.entry,
            self.reason
        )
    }
}

/// The visible devices and, when the list stopped at an entry that is not trailing and
/// empty, where.
pub(crate) fn resolve_detailed(
    spec: Option<&str>,
    physical: &[PhysicalDevice],
) -> Result<(VisibleDevices, Option<StoppedAt>)> {
    let Some(spec) = spec else {
        return Ok((VisibleDevices::all(physical), None));
    };
    if spec.trim().is_empty() {
        return Ok((VisibleDevices::none(), None));
    }
    let entries: Vec<&str> = spec.split(',').map(str::trim).collect();
    let mut order: Vec<u32> = Vec::new();
    let mut named_as: Vec<&str> = Vec::new();
    for (position, &entry) in entries.iter().enumerate() {
        match resolve_entry(entry, physical) {
            Ok(index) => {
                if let Some(pos) = order.iter().position(|&p| p == index) {
                    let first = named_as[pos];
                    let how = if first == entry {
                        format!("{entry:?} is listed twice")
                    } else {
                        format!("{first:?} and {entry:?} name the same device")
                    };
                    return Err(Error::InvalidDeviceList(format!(
                        "{CUDA_VISIBLE_DEVICES}={spec:?} names GPU {index} more than once ({how}); \
                         list each device once"
                    )));
                }
                order.push(index);
                named_as.push(entry);
            }
            Err(reason) => {
                let trailing_empty = entry.is_empty() && position + 1 == entries.len();
                let stopped = StoppedAt { position, entry: entry.to_string(), reason };
                if trailing_empty {
                    return Ok((VisibleDevices { order }, None));
                }
                return Ok((VisibleDevices { order }, Some(stopped)));
            }
        }
    }
    Ok((VisibleDevices { order }, None))
}

/// Resolves one entry to a physical index, or says why it is not valid.
fn resolve_entry(entry: &str, physical: &[PhysicalDevice]) -> std::result::Result<u32, String> {
    if entry.is_empty() {
        return Err("is empty".to_string());
    }
    if entry.bytes().all(|b| b.is_ascii_digit()) {
        let known = || {
            let mut idx: Vec<u32> = physical.iter().map(|d| d.index).collect();
            idx.sort_unstable();
            if idx.is_empty() {
                "there are no devices".to_string()
            } else {
                format!("indices are {idx:?}")
            }
        };
        return match entry.parse::<u32>() {
            Ok(i) if physical.iter().any(|d| d.index == i) => Ok(i),
            _ => Err(format!("is not the index of a device ({})", known())),
        };
    }
    if let Some(digits) = entry.strip_prefix('-') {
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err("is negative".to_string());
        }
    }
    let has_prefix =
        |prefix: &[u8]| entry.as_bytes().get(..prefix.len()).is_some_and(|p| p.eq_ignore_ascii_case(prefix));
    if has_prefix(b"mig-") {
        return Err("is a MIG instance, which is not supported".to_string());
    }
    let is_uuid_like =
        entry.len() > 4 && has_prefix(b"gpu-") && entry.bytes().skip(4).all(|b| b.is_ascii_hexdigit() || b == b'-');
    if !is_uuid_like {
        return Err("is neither a device index nor a GPU UUID (GPU-...)".to_string());
    }
    let matching: Vec<&PhysicalDevice> = physical
        .iter()
        .filter(|d| {
            d.uuid.as_deref().is_some_and(|u| {
                u.as_bytes().get(..entry.len()).is_some_and(|p| p.eq_ignore_ascii_case(entry.as_bytes()))
            })
        })
        .collect();
    match matching.as_slice() {
        [one] => Ok(one.index),
        [] => Err("matches no device's UUID".to_string()),
        many => {
            let which: Vec<String> = many.iter().map(|d| d.index.to_string()).collect();
            Err(format!("is a UUID prefix shared by GPUs {}", which.join(", ")))
        }
    }
}

/// Applies CUDA's `CUDA_VISIBLE_DEVICES` rules to `physical`, as a pure function of the
/// variable's value and the physical devices:
///
/// * unset: every device, in physical (index) order;
/// * empty (or only whitespace): no device;
/// * otherwise a comma-separated list; whitespace around each entry is ignored. An entry is
///   - a decimal index (ASCII digits only, leading zeros allowed) of a physical device, or
///   - `GPU-` followed by at least one hex digit or dash: a device UUID or a prefix of one,
///     compared without regard to case, which must match exactly one device's UUID.
///
///   The list ends at the first entry that is not valid: a negative number (so `-1` first
///   hides every device), an index no device has, anything else that is not a number, a UUID
///   prefix matching no device or more than one, a MIG instance (`MIG-...`, not supported),
///   an empty entry (so a trailing comma is harmless). The entries before it are kept; it and
///   every entry after it are ignored, and a warning names it.
/// * Naming a device twice among the kept entries (by index, UUID or both) is an error.
///
/// The position of a device in the list is its logical index: with `2,3`, logical GPU 0 is
/// physical GPU 2.
///
/// `spec` is the variable's value, `None` when it is unset. An entry that ends the list early
/// is logged with `tracing::warn`. Fails with [`Error::InvalidDeviceList`] when a device is
/// named twice.
pub fn resolve_visible_devices(spec: Option<&str>, physical: &[PhysicalDevice]) -> Result<VisibleDevices> {
    let (visible, stopped) = resolve_detailed(spec, physical)?;
    if let Some(stopped) = stopped {
        tracing::warn!("{CUDA_VISIBLE_DEVICES}={:?}: {stopped}; using GPUs [{visible}]", spec.unwrap_or_default());
    }
    Ok(visible)
}

/// The value of `CUDA_VISIBLE_DEVICES` in this process (`None` when unset).
pub fn cuda_visible_devices_env() -> Result<Option<String>> {
    match std::env::var_os(CUDA_VISIBLE_DEVICES) {
        None => Ok(None),
        Some(value) => value.into_string().map(Some).map_err(|value| {
            Error::InvalidDeviceList(format!(
                "{CUDA_VISIBLE_DEVICES}={value:?} is not valid unicode; set it to indices or GPU UUIDs \
                 separated by commas"
            ))
        }),
    }
}

/// [`resolve_visible_devices`] with the value of `CUDA_VISIBLE_DEVICES` in this process.
pub fn visible_devices_from_env(physical: &[PhysicalDevice]) -> Result<VisibleDevices> {
    let value = cuda_visible_devices_env()?;
    resolve_visible_devices(value.as_deref(), physical)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceType;

    /// Six fake GPUs; GPUs 4 and 5 share the UUID prefix `GPU-eeee`.
    fn gpus() -> Vec<PhysicalDevice> {
        let uuids = [
            "GPU-aaaaaaaa-0000-0000-0000-000000000000",
            "GPU-bbbbbbbb-1111-1111-1111-111111111111",
            "GPU-cccccccc-2222-2222-2222-222222222222",
            "GPU-dddddddd-3333-3333-3333-333333333333",
            "GPU-eeee0000-4444-4444-4444-444444444444",
            "GPU-eeee1111-5555-5555-5555-555555555555",
        ];
        uuids
            .iter()
            .enumerate()
            .map(|(i, uuid)| PhysicalDevice {
                index: i as u32,
                device_type: DeviceType::Gpu,
                name: format!("Fake GPU {i}"),
                uuid: Some(uuid.to_string()),
                memory_bytes: Some(80 << 30),
                compute_capability: Some((9, 0)),
                cores: Some(132),
            })
            .collect()
    }

    /// The first four GPUs only.
    fn four() -> Vec<PhysicalDevice> {
        gpus().into_iter().take(4).collect()
    }

    enum Want {
        Order(&'static [u32]),
        /// An `InvalidDeviceList` error whose message contains these strings.
        Err(&'static [&'static str]),
    }

    #[test]
    fn cuda_visible_devices_table() {
        use Want::*;
        let six = gpus();
        let four = four();
        #[rustfmt::skip]
        let table: Vec<(Option<&str>, &[PhysicalDevice], Want)> = vec![
            (None, &six, Order(&[0, 1, 2, 3, 4, 5])),
            (None, &four, Order(&[0, 1, 2, 3])),
            (None, &[], Order(&[])),
            (Some(""), &six, Order(&[])),
            (Some("   "), &six, Order(&[])),
            (Some("-1"), &six, Order(&[])),
            (Some("-1,0,1"), &six, Order(&[])),
            (Some("0,-1,1"), &six, Order(&[0])),
            (Some("2,3,4,5"), &six, Order(&[2, 3, 4, 5])),
            (Some("2,1,3"), &six, Order(&[2, 1, 3])),
            (Some("0,9,1"), &four, Order(&[0])),
            (Some("4"), &four, Order(&[])),
            (Some("1,abc,2"), &six, Order(&[1])),
            (Some(" 1 , 2 "), &six, Order(&[1, 2])),
            (Some("1,2,"), &six, Order(&[1, 2])),
            (Some("1,,2"), &six, Order(&[1])),
            (Some(","), &six, Order(&[])),
            (Some("003"), &six, Order(&[3])),
            (Some("007"), &six, Order(&[])),
            (Some("é,1"), &six, Order(&[])),
            (Some("1,GPé-1"), &six, Order(&[1])),
            (Some("03,1"), &six, Order(&[3, 1])),
            (Some("+1"), &six, Order(&[])),
            (Some("1.0"), &six, Order(&[])),
            (Some("1 2"), &six, Order(&[])),
            (Some("99999999999999"), &six, Order(&[])),
            (Some("GPU-cccccccc-2222-2222-2222-222222222222"), &six, Order(&[2])),
            (Some("GPU-CCCCCCCC-2222-2222-2222-222222222222,0"), &six, Order(&[2, 0])),
            (Some("GPU-dd,GPU-b"), &six, Order(&[3, 1])),
            (Some("1,GPU-eeee,2"), &six, Order(&[1])),
            (Some("GPU-eeee1"), &six, Order(&[5])),
            (Some("GPU-ffff,0"), &six, Order(&[])),
            (Some("GPU-"), &six, Order(&[])),
            (Some("GPU-xyz,1"), &six, Order(&[])),
            (Some("cccccccc-2222-2222-2222-222222222222"), &six, Order(&[])),
            (Some("0,MIG-GPU-aaaaaaaa-0000-0000-0000-000000000000/1/0,1"), &six, Order(&[0])),
            (Some("GPU-aaaaaaaa-0000-0000-0000-000000000000-extra"), &six, Order(&[])),
            (Some("1,1"), &six, Err(&["GPU 1", "\"1\" is listed twice", "list each device once"])),
            (Some("0,2,0"), &six, Err(&["GPU 0", "list each device once"])),
            (Some("GPU-bbbb,1"), &six, Err(&["GPU 1", "\"GPU-bbbb\" and \"1\" name the same device"])),
            (Some("3,GPU-dddddddd-3333-3333-3333-333333333333"), &six, Err(&["GPU 3", "list each device once"])),
            (Some("01,1"), &six, Err(&["GPU 1"])),
            (Some("1,x,1"), &six, Order(&[1])),
        ];
        assert!(table.len() >= 20);
        for (i, (spec, physical, want)) in table.iter().enumerate() {
            let got = resolve_visible_devices(*spec, physical);
            match (want, got) {
                (Order(order), Ok(v)) => assert_eq!(v.order, *order, "row {i}: {spec:?}"),
                (Order(order), Result::Err(e)) => panic!("row {i}: {spec:?} want {order:?}, got error {e}"),
                (Err(_), Ok(v)) => panic!("row {i}: {spec:?} want an error, got {v:?}"),
                (Err(needles), Result::Err(e)) => {
                    assert!(matches!(e, Error::InvalidDeviceList(_)), "row {i}: {e:?}");
                    let msg = e.to_string();
                    for needle in *needles {
                        assert!(msg.contains(needle), "row {i}: {msg:?} lacks {needle:?}");
                    }
                    assert!(!msg.ends_with('.'), "{msg}");
                }
            }
        }
    }

    #[test]
    fn logical_and_physical_mappings() {
        let v = resolve_visible_devices(Some("2,3,4,5"), &gpus()).unwrap();
        assert_eq!(v.physical_of(1), Some(3));
        assert_eq!(v.physical_of(4), None);
        assert_eq!(v.logical_of(5), Some(3));
        assert_eq!(v.logical_of(0), None);
        assert_eq!(v.len(), 4);
        assert!(!v.is_empty());
        assert!(v.contains(4) && !v.contains(1));
        assert_eq!(v.iter().collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        assert_eq!(v.to_string(), "2,3,4,5");

        let v = resolve_visible_devices(Some("2,1,3"), &gpus()).unwrap();
        assert_eq!(v.logical_of(2), Some(0));
        assert_eq!(v.physical_of(0), Some(2));

        let unset = resolve_visible_devices(None, &gpus()).unwrap();
        for i in 0..6 {
            assert_eq!(unset.physical_of(i), Some(i));
            assert_eq!(unset.logical_of(i), Some(i));
        }
        assert!(VisibleDevices::none().is_empty());
        assert_eq!(VisibleDevices::none().to_string(), "");
    }

    #[test]
    fn all_sorts_by_index() {
        let mut devices = gpus();
        devices.reverse();
        assert_eq!(VisibleDevices::all(&devices).order, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn stop_reasons_are_reported() {
        let (v, stopped) = resolve_detailed(Some("1,GPU-eeee,2"), &gpus()).unwrap();
        assert_eq!(v.order, vec![1]);
        let stopped = stopped.unwrap();
        assert_eq!(stopped.position, 1);
        assert_eq!(stopped.entry, "GPU-eeee");
        assert!(stopped.reason.contains("shared by GPUs 4, 5"), "{}", stopped.reason);
        assert!(stopped.to_string().contains("entry 2 (\"GPU-eeee\")"), "{stopped}");

        let (_, stopped) = resolve_detailed(Some("0,9"), &four()).unwrap();
        assert!(stopped.unwrap().reason.contains("[0, 1, 2, 3]"));
        let (_, stopped) = resolve_detailed(Some("0"), &[]).unwrap();
        assert!(stopped.unwrap().reason.contains("there are no devices"));
        let (_, stopped) = resolve_detailed(Some("-1"), &four()).unwrap();
        assert_eq!(stopped.unwrap().reason, "is negative");
        let (_, stopped) = resolve_detailed(Some("0,1,"), &four()).unwrap();
        assert_eq!(stopped, None, "a trailing comma is not worth a warning");
        let (_, stopped) = resolve_detailed(Some("MIG-1"), &four()).unwrap();
        assert!(stopped.unwrap().reason.contains("MIG"));
    }

    #[test]
    fn devices_without_uuid_are_matched_by_index_only() {
        let mut devices = four();
        devices[1].uuid = None;
        assert_eq!(resolve_visible_devices(Some("1,GPU-a"), &devices).unwrap().order, vec![1, 0]);
        assert_eq!(resolve_visible_devices(Some("GPU-b"), &devices).unwrap().order, Vec::<u32>::new());
    }

    #[test]
    fn sparse_indices() {
        let devices: Vec<PhysicalDevice> = gpus().into_iter().filter(|d| d.index % 2 == 0).collect(); // 0, 2, 4
        assert_eq!(resolve_visible_devices(Some("4,2,1,0"), &devices).unwrap().order, vec![4, 2]);
        assert_eq!(resolve_visible_devices(None, &devices).unwrap().order, vec![0, 2, 4]);
    }

    #[test]
    fn from_env_reads_the_variable() {
        // Only reads: the test does not set the variable (that would race with other tests).
        let expected = std::env::var(CUDA_VISIBLE_DEVICES).ok();
        assert_eq!(cuda_visible_devices_env().unwrap(), expected);
        let direct = resolve_visible_devices(expected.as_deref(), &gpus());
        let from_env = visible_devices_from_env(&gpus());
        assert_eq!(direct.ok(), from_env.ok());
    }

    #[test]
    fn serde_round_trip() {
        let v = VisibleDevices::new(vec![2, 0]);
        let json = serde_json::to_string(&v).unwrap();
        assert_eq!(json, "{\"order\":[2,0]}");
        assert_eq!(serde_json::from_str::<VisibleDevices>(&json).unwrap(), v);
    }
}

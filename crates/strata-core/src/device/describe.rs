//! A human-readable report of the devices, for `strata devices`.

use std::fmt::Write as _;

use super::logical::LogicalKind;
use super::memory::format_bytes;
use super::registry::DeviceRegistry;
use super::spec::DeviceType;
use super::visibility::CUDA_VISIBLE_DEVICES;
use crate::Result;

/// Describes the physical devices of `registry` (index, type, name, UUID, memory, cores, and
/// the logical devices each becomes), the visibility in effect (`CUDA_VISIBLE_DEVICES`, or
/// visible devices set explicitly), and the logical devices. Does not initialize the
/// registry: when it is not initialized yet, shows what initialization would give.
pub fn describe_devices(registry: &DeviceRegistry) -> Result<String> {
    let physical = registry.list_physical_devices(None)?;
    let logical = registry.preview_logical_devices()?;
    let mut out = String::new();

    out.push_str("Physical devices:\n");
    let mut rows = vec![row(["INDEX", "TYPE", "NAME", "UUID", "MEMORY", "CORES", "LOGICAL DEVICES"])];
    for d in &physical {
        let mine: Vec<String> = logical
            .iter()
            .filter(|l| l.physical.device_type == d.device_type && l.physical.index == d.index)
            .map(|l| l.spec.to_string())
            .collect();
        rows.push(vec![
            d.index.to_string(),
            d.device_type.to_string(),
            d.name.clone(),
            d.uuid.clone().unwrap_or_else(|| "-".to_string()),
            d.memory_bytes.map_or_else(|| "-".to_string(), format_bytes),
            d.cores.map_or_else(|| "-".to_string(), |c| c.to_string()),
            if mine.is_empty() { "(not visible)".to_string() } else { mine.join(", ") },
        ]);
    }
    write_table(&mut out, &rows, 2);

    if !registry.has_enumerator(DeviceType::Gpu) {
        out.push_str("GPUs: no GPU enumerator registered (build with the cuda feature)\n");
    } else if !physical.iter().any(|d| d.device_type == DeviceType::Gpu) {
        out.push_str("GPUs: none found\n");
    }

    let env = match registry.cuda_visible_devices()? {
        Some(value) => format!("{value:?}"),
        None => "unset (all GPUs visible)".to_string(),
    };
    let _ = writeln!(out, "{CUDA_VISIBLE_DEVICES}: {env}");
    if registry.visible_devices_overridden(DeviceType::Gpu) {
        let visible = registry.visible_devices(DeviceType::Gpu)?;
        let _ = writeln!(out, "  overridden by set_visible_devices: GPUs [{visible}]");
    } else if let Some(stopped) = registry.cuda_visible_devices_stop()? {
        let _ = writeln!(out, "  note: {stopped}");
    }
    if registry.visible_devices_overridden(DeviceType::Cpu) {
        let visible = registry.visible_devices(DeviceType::Cpu)?;
        let _ = writeln!(out, "visible CPUs set by set_visible_devices: [{visible}]");
    }

    let state = if registry.is_initialized() { "" } else { " (not initialized yet)" };
    let _ = writeln!(out, "\nLogical devices{state}:");
    let mut rows = vec![row(["DEVICE", "PHYSICAL", "SHARE"])];
    for l in &logical {
        let share = match l.kind {
            LogicalKind::Cpu { threads, memory_limit } => {
                let threads = if threads == 1 { "1 thread".to_string() } else { format!("{threads} threads") };
                match memory_limit {
                    Some(limit) => format!("{threads}, {} memory limit", format_bytes(limit)),
                    None => threads,
                }
            }
            LogicalKind::Gpu { memory_limit: Some(limit) } => format!("{} memory limit", format_bytes(limit)),
            LogicalKind::Gpu { memory_limit: None } => "whole device".to_string(),
        };
        rows.push(vec![l.spec.to_string(), l.physical.label(), share]);
    }
    if logical.is_empty() {
        out.push_str("  none\n");
    } else {
        write_table(&mut out, &rows, 2);
    }
    Ok(out)
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.iter().map(|c| c.to_string()).collect()
}

/// Appends `rows` to `out` as left-aligned columns, indented by two spaces and separated by
/// `gap` spaces, each line without trailing spaces: the tables of `strata devices` (this
/// module's use 2, strata-cuda's GPU report 1).
pub fn write_table(out: &mut String, rows: &[Vec<String>], gap: usize) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let mut line = String::from("  ");
        for (c, cell) in r.iter().enumerate() {
            if c > 0 {
                line.extend(std::iter::repeat_n(' ', gap));
            }
            let _ = write!(line, "{cell:<width$}", width = widths[c]);
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{LogicalDeviceConfiguration, StaticEnumerator};

    #[test]
    fn cpu_only() {
        let r = DeviceRegistry::new().with_cuda_visible_devices(None);
        let text = describe_devices(&r).unwrap();
        assert!(text.contains("Physical devices:"), "{text}");
        assert!(text.contains("no GPU enumerator registered (build with the cuda feature)"), "{text}");
        assert!(text.contains("CUDA_VISIBLE_DEVICES: unset"), "{text}");
        assert!(text.contains("Logical devices (not initialized yet):"), "{text}");
        assert!(text.contains("/device:CPU:0"), "{text}");
        assert!(!r.is_initialized(), "describing does not initialize");
        assert!(text.lines().all(|l| l == l.trim_end()), "no trailing spaces:\n{text}");
    }

    #[test]
    fn gpus_with_visibility() {
        let r = DeviceRegistry::new().with_cuda_visible_devices(Some("2,0,zz,1"));
        r.register_enumerator(Box::new(StaticEnumerator::fake_gpus(3, 16 << 30))).unwrap();
        let gpus = r.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        r.set_logical_device_configuration(
            &gpus[2],
            vec![LogicalDeviceConfiguration::gpu(4 << 30), LogicalDeviceConfiguration::gpu(4 << 30)],
        )
        .unwrap();
        r.initialize().unwrap();
        let text = describe_devices(&r).unwrap();
        assert!(text.contains("CUDA_VISIBLE_DEVICES: \"2,0,zz,1\""), "{text}");
        assert!(text.contains("entry 3 (\"zz\")"), "{text}");
        assert!(text.contains("GPU-00000001-0000-0000-0000-000000000000"), "{text}");
        assert!(text.contains("16.0 GiB"), "{text}");
        assert!(text.contains("(not visible)"), "{text}");
        assert!(text.contains("/device:GPU:0, /device:GPU:1"), "{text}");
        assert!(text.contains("4.0 GiB memory limit"), "{text}");
        assert!(text.contains("whole device"), "{text}");
        assert!(text.contains("Logical devices:"), "{text}");
        assert!(!text.contains("no GPU enumerator"), "{text}");
    }

    #[test]
    fn overridden_and_empty() {
        let r = DeviceRegistry::new().with_cuda_visible_devices(Some("0"));
        r.register_enumerator(Box::new(StaticEnumerator::fake_gpus(2, 1 << 30))).unwrap();
        let gpus = r.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        r.set_visible_devices(&gpus[1..], DeviceType::Gpu).unwrap();
        let text = describe_devices(&r).unwrap();
        assert!(text.contains("overridden by set_visible_devices: GPUs [1]"), "{text}");

        let r = DeviceRegistry::new().with_cuda_visible_devices(None);
        r.register_enumerator(Box::new(StaticEnumerator::fake_gpus(0, 1))).unwrap();
        let text = describe_devices(&r).unwrap();
        assert!(text.contains("GPUs: none found"), "{text}");
    }

    #[test]
    fn table_aligns_columns() {
        let mut out = String::new();
        write_table(&mut out, &[row(["A", "BB"]), row(["CCC", "D"])], 2);
        assert_eq!(out, "  A    BB\n  CCC  D\n");
    }

    #[test]
    fn tables_are_left_aligned_columns_with_a_gap_and_no_trailing_spaces() {
        let rows = vec![row(["A", "BB", ""]), row(["CCC", "D", "E"])];
        let mut two = String::new();
        write_table(&mut two, &rows, 2);
        assert_eq!(two, "  A    BB\n  CCC  D   E\n");
        let mut one = String::new();
        write_table(&mut one, &rows, 1);
        assert_eq!(one, "  A   BB\n  CCC D  E\n");
    }
}

//! Physical devices and the enumerators that find them.

use super::spec::DeviceType;
use crate::Result;

/// A device as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct PhysicalDevice {
    /// The ordinal the driver enumerates the device under. For GPUs found through the CUDA
    /// driver this is the CUDA ordinal in this process, which every CUDA call takes: the
    /// driver applies `CUDA_VISIBLE_DEVICES` itself when it starts, so with `2,3` the boards
    /// `nvidia-smi` numbers 2 and 3 are ordinals 0 and 1 here (the UUID says which board it is;
    /// see `strata_cuda::device`). A list built without the driver (tests, simulations) may use
    /// `nvidia-smi`'s numbering and let the registry apply the variable instead.
    pub index: u32,
    /// CPU or GPU.
    pub device_type: DeviceType,
    /// The model name (`"NVIDIA H100 80GB HBM3"`, `"AMD EPYC 7B13"`).
    pub name: String,
    /// The device's UUID, for GPUs `"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"`.
    pub uuid: Option<String>,
    /// Total memory in bytes, where known.
    pub memory_bytes: Option<u64>,
    /// CUDA compute capability `(major, minor)`, for GPUs.
    pub compute_capability: Option<(u32, u32)>,
    /// Hardware threads (CPUs) or streaming multiprocessors (GPUs), where known.
    pub cores: Option<usize>,
}

impl PhysicalDevice {
    /// A short label, `"GPU 1"`.
    pub fn label(&self) -> String {
        format!("{} {}", self.device_type, self.index)
    }
}

/// Finds the physical devices of one type.
///
/// GPU enumerators live in other crates (behind the `cuda` feature) and are registered with
/// [`DeviceRegistry::register_enumerator`](super::DeviceRegistry::register_enumerator).
pub trait DeviceEnumerator: Send + Sync {
    /// The type of the devices this enumerator reports.
    fn device_type(&self) -> DeviceType;

    /// Every device of [`DeviceEnumerator::device_type`], with the driver's ordinals as
    /// indices. Unless [`DeviceEnumerator::applies_cuda_visible_devices`] says otherwise, the
    /// list must not be filtered by `CUDA_VISIBLE_DEVICES` (enumerate through NVML, say): the
    /// registry applies that variable itself.
    fn physical_devices(&self) -> Result<Vec<PhysicalDevice>>;

    /// Whether [`DeviceEnumerator::physical_devices`] already reflects `CUDA_VISIBLE_DEVICES`
    /// (true for enumerators built on the CUDA runtime, whose ordinals are the visible ones).
    /// The registry then does not apply the variable a second time.
    fn applies_cuda_visible_devices(&self) -> bool {
        false
    }
}

/// The host CPU, as one physical device (index 0) whose `cores` are the threads available to
/// the process.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuEnumerator;

impl DeviceEnumerator for CpuEnumerator {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cpu
    }

    fn physical_devices(&self) -> Result<Vec<PhysicalDevice>> {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let name = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|text| cpu_model_name(&text))
            .unwrap_or_else(|| "cpu".to_string());
        let memory_bytes = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| mem_total_bytes(&text));
        Ok(vec![PhysicalDevice {
            index: 0,
            device_type: DeviceType::Cpu,
            name,
            uuid: None,
            memory_bytes,
            compute_capability: None,
            cores: Some(cores),
        }])
    }
}

/// An enumerator returning a fixed list: for tests, simulations and `--fake-gpus`.
#[derive(Clone, Debug)]
pub struct StaticEnumerator {
    device_type: DeviceType,
    devices: Vec<PhysicalDevice>,
    applies_cuda_visible_devices: bool,
}

impl StaticEnumerator {
    /// An enumerator of `devices`, which must all be of `device_type` (others are dropped).
    pub fn new(device_type: DeviceType, devices: Vec<PhysicalDevice>) -> Self {
        let devices = devices.into_iter().filter(|d| d.device_type == device_type).collect();
        StaticEnumerator { device_type, devices, applies_cuda_visible_devices: false }
    }

    /// `n` fake GPUs with `memory_bytes` each, named `"Fake GPU <i>"`, with UUIDs
    /// `GPU-<i as 8 hex digits>-0000-0000-0000-000000000000`.
    pub fn fake_gpus(n: u32, memory_bytes: u64) -> Self {
        let devices = (0..n)
            .map(|i| PhysicalDevice {
                index: i,
                device_type: DeviceType::Gpu,
                name: format!("Fake GPU {i}"),
                uuid: Some(format!("GPU-{i:08x}-0000-0000-0000-000000000000")),
                memory_bytes: Some(memory_bytes),
                compute_capability: Some((9, 0)),
                cores: None,
            })
            .collect();
        StaticEnumerator::new(DeviceType::Gpu, devices)
    }

    /// Sets what [`DeviceEnumerator::applies_cuda_visible_devices`] returns.
    pub fn with_cuda_visible_devices_applied(mut self, applied: bool) -> Self {
        self.applies_cuda_visible_devices = applied;
        self
    }
}

impl DeviceEnumerator for StaticEnumerator {
    fn device_type(&self) -> DeviceType {
        self.device_type
    }

    fn physical_devices(&self) -> Result<Vec<PhysicalDevice>> {
        Ok(self.devices.clone())
    }

    fn applies_cuda_visible_devices(&self) -> bool {
        self.applies_cuda_visible_devices
    }
}

/// The first `model name` of a `/proc/cpuinfo` text.
fn cpu_model_name(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        let value = value.trim();
        (key.trim() == "model name" && !value.is_empty()).then(|| value.to_string())
    })
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total_bytes(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("MemTotal:")?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        kib.checked_mul(1024)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_enumerator_reports_one_device() {
        let e = CpuEnumerator;
        assert_eq!(e.device_type(), DeviceType::Cpu);
        assert!(!e.applies_cuda_visible_devices());
        let devices = e.physical_devices().unwrap();
        assert_eq!(devices.len(), 1);
        let cpu = &devices[0];
        assert_eq!(cpu.index, 0);
        assert_eq!(cpu.device_type, DeviceType::Cpu);
        assert!(!cpu.name.is_empty());
        assert_eq!(cpu.uuid, None);
        assert_eq!(cpu.cores, Some(std::thread::available_parallelism().unwrap().get()));
        assert_eq!(cpu.label(), "CPU 0");
    }

    #[test]
    fn parses_proc_files() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n\
                       processor\t: 1\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n";
        assert_eq!(cpu_model_name(cpuinfo).as_deref(), Some("AMD EPYC 7B13 64-Core Processor"));
        assert_eq!(cpu_model_name("processor : 0\nBogoMIPS : 50.00\n"), None);
        assert_eq!(cpu_model_name("model name :   \n"), None);
        let meminfo = "MemTotal:       131891220 kB\nMemFree:        1000 kB\n";
        assert_eq!(mem_total_bytes(meminfo), Some(131_891_220 * 1024));
        assert_eq!(mem_total_bytes("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn static_enumerator() {
        let e = StaticEnumerator::fake_gpus(3, 1 << 30);
        assert_eq!(e.device_type(), DeviceType::Gpu);
        let devices = e.physical_devices().unwrap();
        assert_eq!(devices.len(), 3);
        assert_eq!(devices[2].uuid.as_deref(), Some("GPU-00000002-0000-0000-0000-000000000000"));
        assert_eq!(devices[1].memory_bytes, Some(1 << 30));
        assert!(e.with_cuda_visible_devices_applied(true).applies_cuda_visible_devices());
        let mixed = StaticEnumerator::new(DeviceType::Cpu, devices);
        assert!(mixed.physical_devices().unwrap().is_empty());
    }

    #[test]
    fn physical_device_serde() {
        let d = StaticEnumerator::fake_gpus(1, 42).physical_devices().unwrap().remove(0);
        let json = serde_json::to_string(&d).unwrap();
        assert!(json.contains("\"device_type\":\"GPU\""), "{json}");
        assert_eq!(serde_json::from_str::<PhysicalDevice>(&json).unwrap(), d);
    }
}

//! Logical devices: what replicas run on, one or more per physical device.

use super::memory::format_bytes;
use super::physical::{CpuEnumerator, DeviceEnumerator, PhysicalDevice};
use super::spec::{DeviceSpec, DeviceType};
use crate::{Error, Result};

/// What a logical device gets of its physical device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum LogicalKind {
    /// A share of the host CPU.
    Cpu {
        /// Threads for the device's kernels.
        threads: usize,
        /// The memory its replica's model state (parameters, gradients, optimizer state) may
        /// take in bytes, `None` for no limit: checked when an optimizer is built
        /// (`Replicated::optimizer`), which names the ZeRO stage that fits.
        #[serde(default)]
        memory_limit: Option<u64>,
    },
    /// A share of a GPU.
    Gpu {
        /// The memory the device may use in bytes, `None` for the whole GPU.
        memory_limit: Option<u64>,
    },
}

/// A device replicas can be placed on (TensorFlow's `LogicalDevice`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LogicalDevice {
    /// Its name, `/device:CPU:1`.
    pub spec: DeviceSpec,
    /// The physical device it runs on.
    pub physical: PhysicalDevice,
    /// Its share of the physical device.
    pub kind: LogicalKind,
}

impl LogicalKind {
    /// The device's memory limit in bytes, if it has one.
    pub fn memory_limit(&self) -> Option<u64> {
        match *self {
            LogicalKind::Cpu { memory_limit, .. } | LogicalKind::Gpu { memory_limit } => memory_limit,
        }
    }
}

impl LogicalDevice {
    /// The device type.
    pub fn device_type(&self) -> DeviceType {
        self.physical.device_type
    }

    /// The logical index within its type.
    pub fn index(&self) -> u32 {
        self.spec.device_index.unwrap_or(0)
    }
}

/// How to carve a logical device out of a physical one, like
/// `tf.config.LogicalDeviceConfiguration`: CPU devices take `threads` (and may take a
/// `memory_limit`), GPU devices `memory_limit` (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LogicalDeviceConfiguration {
    /// Threads of a logical CPU device (at least 1).
    pub threads: Option<usize>,
    /// Memory of a logical device in bytes (a GPU's, or what a CPU device's replica may hold).
    pub memory_limit: Option<u64>,
}

impl LogicalDeviceConfiguration {
    /// A logical CPU device with `threads` threads.
    pub fn cpu(threads: usize) -> Self {
        LogicalDeviceConfiguration { threads: Some(threads), memory_limit: None }
    }

    /// A logical CPU device with `threads` threads whose replica may hold `memory_limit` bytes
    /// of model state.
    pub fn cpu_limited(threads: usize, memory_limit: u64) -> Self {
        LogicalDeviceConfiguration { threads: Some(threads), memory_limit: Some(memory_limit) }
    }

    /// A logical GPU device with `memory_limit` bytes.
    pub fn gpu(memory_limit: u64) -> Self {
        LogicalDeviceConfiguration { threads: None, memory_limit: Some(memory_limit) }
    }
}

/// The most replicas (logical devices, each run by its own thread with its own copy of the
/// model) one process runs, and the most threads one logical CPU device has: 1024. More are
/// refused before any thread starts; a machine needs a core per replica thread to be of use.
pub const MAX_REPLICAS: usize = 1024;

/// Refuses `n` replicas (or threads) over [`MAX_REPLICAS`]; `what` names what is counted.
pub fn check_replicas(n: usize, what: &str) -> Result<()> {
    if n > MAX_REPLICAS {
        return Err(Error::InvalidDeviceList(format!(
            "{n} {what}, over the limit of {MAX_REPLICAS} per process (one thread each); ask for fewer"
        )));
    }
    Ok(())
}

/// Splits `physical` into one logical device per configuration, named
/// `/device:<type>:<first_index + i>`.
///
/// CPU configurations need `threads >= 1` and may set a positive `memory_limit`; GPU configurations need a
/// positive `memory_limit` and no `threads`, and their limits together must fit the device's
/// memory when it is known. `configs` must not be empty, nor longer than [`MAX_REPLICAS`].
pub fn split_physical(
    physical: &PhysicalDevice,
    configs: &[LogicalDeviceConfiguration],
    first_index: u32,
) -> Result<Vec<LogicalDevice>> {
    let device = physical.label();
    check_replicas(configs.len(), "logical devices")?;
    if configs.is_empty() {
        return Err(Error::InvalidDeviceList(format!(
            "no logical device configuration for {device}; pass at least one"
        )));
    }
    let mut total: u64 = 0;
    let mut out = Vec::with_capacity(configs.len());
    for (i, config) in configs.iter().enumerate() {
        let which = format!("logical device configuration #{i} of {device}");
        let kind = match physical.device_type {
            DeviceType::Cpu => {
                if config.memory_limit == Some(0) {
                    return Err(Error::InvalidMemoryConfig(format!(
                        "{which} has a memory_limit of 0; give it a positive number of bytes, or none"
                    )));
                }
                match config.threads {
                    Some(threads) if threads >= 1 => {
                        check_replicas(threads, &format!("threads for {which}"))?;
                        LogicalKind::Cpu { threads, memory_limit: config.memory_limit }
                    }
                    _ => {
                        return Err(Error::InvalidDeviceList(format!(
                            "{which} needs threads >= 1; set threads to 1 or more"
                        )))
                    }
                }
            }
            DeviceType::Gpu => {
                if config.threads.is_some() {
                    return Err(Error::InvalidDeviceList(format!(
                        "{which} sets threads, which GPU devices do not support; remove it and set \
                         memory_limit"
                    )));
                }
                let limit = match config.memory_limit {
                    Some(limit) if limit > 0 => limit,
                    Some(_) => {
                        return Err(Error::InvalidMemoryConfig(format!(
                            "{which} has a memory_limit of 0; give it a positive number of bytes"
                        )))
                    }
                    None => {
                        return Err(Error::InvalidMemoryConfig(format!(
                            "{which} needs a memory_limit; set memory_limit in bytes"
                        )))
                    }
                };
                total = total.saturating_add(limit);
                LogicalKind::Gpu { memory_limit: Some(limit) }
            }
        };
        let index = u32::try_from(i)
            .ok()
            .and_then(|i| first_index.checked_add(i))
            .ok_or_else(|| Error::InvalidDeviceList(format!("too many logical {} devices", physical.device_type)))?;
        out.push(LogicalDevice {
            spec: DeviceSpec::device(physical.device_type, index),
            physical: physical.clone(),
            kind,
        });
    }
    if let Some(memory) = physical.memory_bytes {
        if physical.device_type == DeviceType::Gpu && total > memory {
            return Err(Error::InvalidMemoryConfig(format!(
                "the memory limits of the {} logical devices of {device} add up to {}, more than its {}; \
                 lower the limits",
                configs.len(),
                format_bytes(total),
                format_bytes(memory)
            )));
        }
    }
    Ok(out)
}

/// The logical device of a physical device without configuration: all its threads or all
/// its memory.
pub(crate) fn whole_device(physical: &PhysicalDevice, index: u32) -> LogicalDevice {
    let kind = match physical.device_type {
        DeviceType::Cpu => LogicalKind::Cpu { threads: physical.cores.unwrap_or(1).max(1), memory_limit: None },
        DeviceType::Gpu => LogicalKind::Gpu { memory_limit: None },
    };
    LogicalDevice { spec: DeviceSpec::device(physical.device_type, index), physical: physical.clone(), kind }
}

/// `n` logical CPU devices `/device:CPU:0` to `/device:CPU:<n-1>` of one thread each on the
/// host CPU, for running several replicas without GPUs.
pub fn logical_cpus(n: usize) -> Result<Vec<LogicalDevice>> {
    if n == 0 {
        return Err(Error::InvalidDeviceList("0 logical CPU devices requested; ask for at least one".to_string()));
    }
    check_replicas(n, "logical CPU devices")?;
    let physical = CpuEnumerator
        .physical_devices()?
        .into_iter()
        .next()
        .ok_or_else(|| Error::UnknownDevice("CPU 0: the CPU enumerator found no CPU".to_string()))?;
    split_physical(&physical, &vec![LogicalDeviceConfiguration::cpu(1); n], 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_replica_counts_are_refused_before_any_device_exists() {
        let e = logical_cpus(100_000).unwrap_err();
        assert!(matches!(e, Error::InvalidDeviceList(_)), "{e}");
        assert_eq!(
            e.to_string(),
            "invalid device list: 100000 logical CPU devices, over the limit of 1024 per process (one thread each); ask for fewer"
        );
        assert_eq!(logical_cpus(MAX_REPLICAS).unwrap().len(), MAX_REPLICAS);
        let e = split_physical(&cpu(), &[LogicalDeviceConfiguration::cpu(1 << 20)], 0).unwrap_err();
        assert!(e.to_string().contains("1048576 threads for logical device configuration #0"), "{e}");
    }

    fn cpu() -> PhysicalDevice {
        PhysicalDevice {
            index: 0,
            device_type: DeviceType::Cpu,
            name: "Test CPU".into(),
            uuid: None,
            memory_bytes: Some(64 << 30),
            compute_capability: None,
            cores: Some(8),
        }
    }

    fn gpu(memory: Option<u64>) -> PhysicalDevice {
        PhysicalDevice {
            index: 1,
            device_type: DeviceType::Gpu,
            name: "Test GPU".into(),
            uuid: Some("GPU-aaaaaaaa-0000-0000-0000-000000000000".into()),
            memory_bytes: memory,
            compute_capability: Some((8, 0)),
            cores: Some(108),
        }
    }

    #[test]
    fn splits_a_cpu() {
        let configs = [LogicalDeviceConfiguration::cpu(2), LogicalDeviceConfiguration::cpu(6)];
        let devices = split_physical(&cpu(), &configs, 3).unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].spec.to_string(), "/device:CPU:3");
        assert_eq!(devices[1].spec.to_string(), "/device:CPU:4");
        assert_eq!(devices[1].kind, LogicalKind::Cpu { threads: 6, memory_limit: None });
        assert_eq!(devices[1].physical, cpu());
        assert_eq!(devices[1].index(), 4);
        assert_eq!(devices[1].device_type(), DeviceType::Cpu);
    }

    #[test]
    fn splits_a_gpu() {
        let configs = [LogicalDeviceConfiguration::gpu(1 << 30), LogicalDeviceConfiguration::gpu(3 << 30)];
        let devices = split_physical(&gpu(Some(4 << 30)), &configs, 0).unwrap();
        assert_eq!(devices[0].spec, DeviceSpec::gpu(0));
        assert_eq!(devices[1].spec, DeviceSpec::gpu(1));
        assert_eq!(devices[1].kind, LogicalKind::Gpu { memory_limit: Some(3 << 30) });
        // Unknown memory: no sum check.
        let many = vec![LogicalDeviceConfiguration::gpu(u64::MAX); 3];
        assert_eq!(split_physical(&gpu(None), &many, 0).unwrap().len(), 3);
    }

    #[test]
    fn validates_configurations() {
        let cases: Vec<(PhysicalDevice, Vec<LogicalDeviceConfiguration>, &str, bool)> = vec![
            (cpu(), vec![], "pass at least one", false),
            (cpu(), vec![LogicalDeviceConfiguration::cpu(0)], "threads >= 1", false),
            (cpu(), vec![LogicalDeviceConfiguration::default()], "threads >= 1", false),
            (
                cpu(),
                vec![LogicalDeviceConfiguration { threads: Some(1), memory_limit: Some(0) }],
                "positive number of bytes, or none",
                true,
            ),
            (gpu(Some(100)), vec![], "pass at least one", false),
            (gpu(Some(100)), vec![LogicalDeviceConfiguration::default()], "needs a memory_limit", true),
            (gpu(Some(100)), vec![LogicalDeviceConfiguration::gpu(0)], "positive number", true),
            (
                gpu(Some(100)),
                vec![LogicalDeviceConfiguration { threads: Some(1), memory_limit: Some(10) }],
                "remove it and set memory_limit",
                false,
            ),
            (
                gpu(Some(100)),
                vec![LogicalDeviceConfiguration::gpu(60), LogicalDeviceConfiguration::gpu(41)],
                "add up to 101 B, more than its 100 B",
                true,
            ),
            (
                gpu(Some(100)),
                vec![LogicalDeviceConfiguration::gpu(u64::MAX), LogicalDeviceConfiguration::gpu(u64::MAX)],
                "lower the limits",
                true,
            ),
        ];
        for (physical, configs, needle, memory_error) in cases {
            let err = split_physical(&physical, &configs, 0).unwrap_err();
            if memory_error {
                assert!(matches!(err, Error::InvalidMemoryConfig(_)), "{err:?}");
            } else {
                assert!(matches!(err, Error::InvalidDeviceList(_)), "{err:?}");
            }
            let msg = err.to_string();
            assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
            assert!(!msg.ends_with('.'), "{msg}");
        }
        // Exactly filling the device is fine.
        let exact = [LogicalDeviceConfiguration::gpu(60), LogicalDeviceConfiguration::gpu(40)];
        assert!(split_physical(&gpu(Some(100)), &exact, 0).is_ok());
        // Index overflow.
        let two = [LogicalDeviceConfiguration::cpu(1); 2];
        assert!(split_physical(&cpu(), &two, u32::MAX).is_err());
    }

    #[test]
    fn logical_cpus_gives_n_single_thread_devices() {
        let devices = logical_cpus(4).unwrap();
        assert_eq!(devices.len(), 4);
        for (i, d) in devices.iter().enumerate() {
            assert_eq!(d.spec, DeviceSpec::cpu(i as u32));
            assert_eq!(d.kind, LogicalKind::Cpu { threads: 1, memory_limit: None });
            assert_eq!(d.physical.index, 0);
            assert_eq!(d.physical.device_type, DeviceType::Cpu);
        }
        let err = logical_cpus(0).unwrap_err();
        assert!(matches!(err, Error::InvalidDeviceList(_)));
        assert!(err.to_string().contains("at least one"), "{err}");
    }

    #[test]
    fn whole_devices() {
        assert_eq!(whole_device(&cpu(), 0).kind, LogicalKind::Cpu { threads: 8, memory_limit: None });
        let mut no_cores = cpu();
        no_cores.cores = None;
        assert_eq!(whole_device(&no_cores, 0).kind, LogicalKind::Cpu { threads: 1, memory_limit: None });
        let g = whole_device(&gpu(Some(1)), 2);
        assert_eq!(g.kind, LogicalKind::Gpu { memory_limit: None });
        assert_eq!(g.spec, DeviceSpec::gpu(2));
    }

    #[test]
    fn serde_round_trip() {
        let d = whole_device(&gpu(Some(1 << 30)), 0);
        let json = serde_json::to_string(&d).unwrap();
        assert!(json.contains("\"spec\":\"/device:GPU:0\""), "{json}");
        assert_eq!(serde_json::from_str::<LogicalDevice>(&json).unwrap(), d);
        let c = LogicalDeviceConfiguration::cpu(2);
        assert_eq!(serde_json::from_str::<LogicalDeviceConfiguration>(&serde_json::to_string(&c).unwrap()).unwrap(), c);
    }
}

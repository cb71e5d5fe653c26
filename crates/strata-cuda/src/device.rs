//! GPU discovery through the CUDA driver, the [`CudaEnumerator`] that gives strata-core's
//! [`DeviceRegistry`] its GPUs, the process's CUDA contexts, and the driver's view of memory.
//!
//! # Discovery creates no context
//!
//! [`discover`] calls `cuInit`, `cuDeviceGetCount`, `cuDeviceGet`, `cuDeviceGetName`,
//! `cuDeviceGetUuid`, `cuDeviceTotalMem`, `cuDeviceGetAttribute` and `cuDeviceCanAccessPeer`,
//! none of which needs or creates a context: listing GPUs costs no GPU memory and leaves the
//! visibility and logical configuration free to change. Contexts are created by `context` (feature
//! `cuda`; one primary context per GPU, shared by the whole process and kept until it exits) the
//! first time something allocates on, launches on, or asks the free memory of a GPU.
//! It probes for the driver first ([`crate::probe::driver`]): without `libcuda.so.1` it is a
//! clear error, never cudarc's panic.
//!
//! # `CUDA_VISIBLE_DEVICES` and the physical list (TensorFlow's way)
//!
//! The CUDA driver reads `CUDA_VISIBLE_DEVICES` itself, once, in `cuInit`: the GPUs it hides do
//! not exist for this process, and the ones it shows are renumbered `0..n` in the listed order.
//! No library call can see past it (only NVML could). So, as in TensorFlow:
//!
//! * the physical GPUs of this process are what the driver shows: [`PhysicalDevice::index`] is
//!   the **CUDA ordinal in this process** (after the variable), which is what every CUDA call
//!   (cudarc, NCCL, candle) takes; the UUID and PCI bus id say which board it is;
//! * [`CudaEnumerator::applies_cuda_visible_devices`] is `true`, so the registry does not apply
//!   the variable a second time (applying `2,3` to a list already reduced to ordinals `0,1`
//!   would hide everything);
//! * `DeviceRegistry::set_visible_devices` then narrows (and reorders) the driver's list
//!   further, and logical device configurations split what stays visible.
//!
//! The composition is the same as applying strata-core's pure
//! [`resolve_visible_devices`] to the full list:
//! [`GpuTopology::as_driver_shows`] simulates the driver's renumbering, and the tests check that
//! both routes give the same logical GPUs (by UUID). Changing `CUDA_VISIBLE_DEVICES` after the
//! driver is initialized has no effect on this process; [`describe_gpus`] shows the mapping
//! from each CUDA ordinal back to the entry of the variable that selected it.
//!
//! The CUDA ordinal order is the driver's (`CUDA_DEVICE_ORDER`: `FASTEST_FIRST` by default,
//! `PCI_BUS_ID` to match `nvidia-smi`'s numbering).

use std::fmt::Write as _;

use strata_core::device::{
    format_bytes, resolve_visible_devices, write_table, DeviceEnumerator, DeviceRegistry, DeviceType, PhysicalDevice,
    CUDA_VISIBLE_DEVICES,
};

use crate::{Error, Result};

/// The variable that orders CUDA ordinals (`FASTEST_FIRST` or `PCI_BUS_ID`).
pub const CUDA_DEVICE_ORDER: &str = "CUDA_DEVICE_ORDER";

/// One GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// The CUDA ordinal in this process (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    /// The model, `"NVIDIA H100 80GB HBM3"`.
    pub name: String,
    /// `"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"`, as `nvidia-smi -L` prints it.
    pub uuid: String,
    /// Total memory in bytes.
    pub total_memory: u64,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// `"00000000:17:00.0"`, as `nvidia-smi` prints it, when the driver reports it.
    pub pci_bus_id: Option<String>,
}

impl GpuInfo {
    /// The strata-core physical device: index = CUDA ordinal, cores = multiprocessors.
    pub fn to_physical(&self) -> PhysicalDevice {
        PhysicalDevice {
            index: self.ordinal,
            device_type: DeviceType::Gpu,
            name: self.name.clone(),
            uuid: Some(self.uuid.clone()),
            memory_bytes: Some(self.total_memory),
            compute_capability: Some(self.compute_capability),
            cores: Some(self.multiprocessors as usize),
        }
    }

    /// A fake GPU from a strata-core physical device (for tests and simulations).
    pub fn from_physical(device: &PhysicalDevice) -> GpuInfo {
        GpuInfo {
            ordinal: device.index,
            name: device.name.clone(),
            uuid: device
                .uuid
                .clone()
                .unwrap_or_else(|| format!("GPU-{:08x}-0000-0000-0000-000000000000", device.index)),
            total_memory: device.memory_bytes.unwrap_or(0),
            compute_capability: device.compute_capability.unwrap_or((0, 0)),
            multiprocessors: device.cores.map_or(0, |c| c as u32),
            pci_bus_id: None,
        }
    }
}

/// The GPUs of this process and which pairs can access each other's memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuTopology {
    /// By ordinal.
    pub gpus: Vec<GpuInfo>,
    /// `peer_access[a][b]`: GPU `a` can access GPU `b`'s memory (`cuDeviceCanAccessPeer`);
    /// `false` on the diagonal.
    pub peer_access: Vec<Vec<bool>>,
}

impl GpuTopology {
    /// GPUs without peer access.
    pub fn new(gpus: Vec<GpuInfo>) -> Self {
        let n = gpus.len();
        GpuTopology { gpus, peer_access: vec![vec![false; n]; n] }
    }

    /// Whether GPU `a` can access GPU `b`'s memory (`false` for `a == b` and unknown GPUs).
    pub fn can_access_peer(&self, a: u32, b: u32) -> bool {
        self.peer_access.get(a as usize).and_then(|row| row.get(b as usize)).copied().unwrap_or(false)
    }

    /// Whether every pair of distinct GPUs among `ordinals` has peer access both ways.
    pub fn all_peers(&self, ordinals: &[u32]) -> bool {
        ordinals.iter().all(|&a| ordinals.iter().all(|&b| a == b || self.can_access_peer(a, b)))
    }

    /// The GPUs as strata-core physical devices.
    pub fn physical_devices(&self) -> Vec<PhysicalDevice> {
        self.gpus.iter().map(GpuInfo::to_physical).collect()
    }

    /// What the driver shows a process started with `CUDA_VISIBLE_DEVICES=cuda_visible_devices`
    /// (`None`: unset) on a machine whose GPUs are `all` (indices as with the variable unset):
    /// the devices strata-core's rules select, renumbered `0..n` in the listed order. Fails as
    /// those rules do (a device named twice).
    pub fn as_driver_shows(all: &[PhysicalDevice], cuda_visible_devices: Option<&str>) -> Result<GpuTopology> {
        let visible = resolve_visible_devices(cuda_visible_devices, all)?;
        let gpus = visible
            .iter()
            .enumerate()
            .filter_map(|(ordinal, index)| {
                let device = all.iter().find(|d| d.index == index)?;
                let mut gpu = GpuInfo::from_physical(device);
                gpu.ordinal = ordinal as u32;
                Some(gpu)
            })
            .collect();
        Ok(GpuTopology::new(gpus))
    }
}

/// `"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"` from the 16 bytes of a `CUuuid`.
pub fn format_uuid(bytes: [u8; 16]) -> String {
    let hex = |range: std::ops::Range<usize>| bytes[range].iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

/// `"00000000:17:00.0"` (domain, bus, device; function 0) as `nvidia-smi` prints it.
pub fn format_pci_bus_id(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:08X}:{bus:02X}:{device:02X}.0")
}

/// The GPUs the driver shows this process, with their peer access. Creates no context.
///
/// Errors: [`Error::NotBuilt`] without the `cuda` feature, [`Error::LibraryMissing`] without a
/// driver, `Error::Driver` when a driver call fails. No GPU at all (including
/// `CUDA_VISIBLE_DEVICES` hiding every GPU, where `cuInit` reports `CUDA_ERROR_NO_DEVICE`) is an
/// empty topology.
pub fn discover() -> Result<GpuTopology> {
    #[cfg(feature = "cuda")]
    {
        driver::discover()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotBuilt { feature: "cuda", what: "GPUs" })
    }
}

/// The number of GPUs the driver shows this process (see [`discover`]).
pub fn gpu_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        driver::count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotBuilt { feature: "cuda", what: "GPUs" })
    }
}

/// The driver's free and total memory of one GPU, in bytes (`cuMemGetInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverMemoryInfo {
    /// Free on the device now, for every process.
    pub free: u64,
    /// The device's memory.
    pub total: u64,
}

/// The driver's free and total memory of GPU `ordinal` (`cuMemGetInfo`). This needs a context:
/// it creates the GPU's primary context through `context` if there is none yet (a few hundred
/// MiB of device memory, kept until the process exits). Strata's own use is
/// [`strata_core::device::memory_info`].
pub fn driver_memory_info(ordinal: u32) -> Result<DriverMemoryInfo> {
    #[cfg(feature = "cuda")]
    {
        let ctx = context(ordinal)?;
        let (free, total) = ctx.mem_get_info().map_err(Error::driver("cuMemGetInfo"))?;
        Ok(DriverMemoryInfo { free: free as u64, total: total as u64 })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(Error::NotBuilt { feature: "cuda", what: "GPUs" })
    }
}

/// The process's context on GPU `ordinal` (its primary context, retained once and shared by
/// every user in the process: allocators, kernels, NCCL). Created at the first call.
#[cfg(feature = "cuda")]
pub fn context(ordinal: u32) -> Result<std::sync::Arc<cudarc::driver::CudaContext>> {
    driver::context(ordinal)
}

/// Registers a [`CudaEnumerator`] with `registry`, after checking that GPUs can be listed: a
/// binary without the `cuda` feature, a machine without a driver, or a failing driver is an
/// error that says so (and the registry keeps listing its CPUs).
pub fn register_cuda_enumerator(registry: &DeviceRegistry) -> Result<()> {
    crate::probe::driver()?;
    gpu_count()?;
    registry.register_enumerator(Box::new(CudaEnumerator::new()))?;
    Ok(())
}

/// strata-core's [`DeviceEnumerator`] for GPUs: the GPUs the CUDA driver shows (see the
/// [module docs](self) for how `CUDA_VISIBLE_DEVICES` composes), or a fixed topology.
#[derive(Clone, Debug, Default)]
pub struct CudaEnumerator {
    fixed: Option<(GpuTopology, bool)>,
}

impl CudaEnumerator {
    /// Enumerates through the driver. Where there is none (or the `cuda` feature is off), the
    /// list is empty and a warning says why; a failing driver is an error.
    pub fn new() -> Self {
        CudaEnumerator { fixed: None }
    }

    /// Enumerates `topology`, as if the driver showed it; `applied` says whether it already
    /// reflects `CUDA_VISIBLE_DEVICES` (true for what [`GpuTopology::as_driver_shows`] gives).
    pub fn from_topology(topology: GpuTopology, applied: bool) -> Self {
        CudaEnumerator { fixed: Some((topology, applied)) }
    }
}

impl DeviceEnumerator for CudaEnumerator {
    fn device_type(&self) -> DeviceType {
        DeviceType::Gpu
    }

    fn physical_devices(&self) -> strata_core::Result<Vec<PhysicalDevice>> {
        if let Some((topology, _)) = &self.fixed {
            return Ok(topology.physical_devices());
        }
        match discover() {
            Ok(topology) => Ok(topology.physical_devices()),
            Err(e @ (Error::NotBuilt { .. } | Error::LibraryMissing { .. })) => {
                tracing::warn!("no GPUs: {e}");
                Ok(Vec::new())
            }
            Err(e) => Err(strata_core::Error::Unavailable(format!("listing GPUs through the CUDA driver: {e}"))),
        }
    }

    /// `true` for the driver (it applied the variable in `cuInit`), the given flag for a fixed
    /// topology.
    fn applies_cuda_visible_devices(&self) -> bool {
        self.fixed.as_ref().is_none_or(|(_, applied)| *applied)
    }
}

/// For each CUDA ordinal `0..count`, the entry of `CUDA_VISIBLE_DEVICES=value` that selected
/// it (the driver keeps the valid entries in order, so ordinal `i` is the `i`-th entry), or
/// `None` when the variable is unset (every GPU, in the driver's order).
pub fn selecting_entries(value: Option<&str>, count: usize) -> Vec<Option<String>> {
    match value {
        None => vec![None; count],
        Some(value) => {
            let mut entries = value.split(',').map(str::trim);
            (0..count).map(|_| entries.next().map(str::to_string)).collect()
        }
    }
}

/// The GPU part of `strata devices`: for each CUDA ordinal, the entry of
/// `CUDA_VISIBLE_DEVICES` that selected it, its UUID, PCI bus id, memory (and, with
/// `driver_memory`, the driver's free memory, which creates a context per GPU), compute
/// capability, the logical devices it becomes, then the peer-access matrix.
pub fn describe_gpus(registry: &DeviceRegistry, topology: &GpuTopology, driver_memory: bool) -> Result<String> {
    let mut out = String::new();
    let env = registry.cuda_visible_devices()?;
    let order = std::env::var(CUDA_DEVICE_ORDER).unwrap_or_else(|_| "unset (FASTEST_FIRST)".to_string());
    let _ = writeln!(
        out,
        "\nGPUs as the CUDA driver shows them ({CUDA_VISIBLE_DEVICES} applied by the driver at cuInit; \
         {CUDA_DEVICE_ORDER}: {order}):"
    );
    if topology.gpus.is_empty() {
        out.push_str("  none\n");
        return Ok(out);
    }
    let logical = registry.preview_logical_devices()?;
    let entries = selecting_entries(env.as_deref(), topology.gpus.len());
    let mut rows: Vec<Vec<String>> =
        vec![["ORDINAL", "SELECTED BY", "UUID", "PCI BUS", "MEMORY", "CC", "SMS", "LOGICAL"]
            .iter()
            .map(|s| s.to_string())
            .collect()];
    if driver_memory {
        rows[0].insert(5, "FREE (DRIVER)".to_string());
    }
    for (gpu, entry) in topology.gpus.iter().zip(&entries) {
        let selected = match entry {
            None => "all (unset)".to_string(),
            Some(e) => format!("{CUDA_VISIBLE_DEVICES} entry {e:?}"),
        };
        let mine: Vec<String> = logical
            .iter()
            .filter(|l| l.physical.device_type == DeviceType::Gpu && l.physical.index == gpu.ordinal)
            .map(|l| l.spec.to_string())
            .collect();
        let mut row = vec![
            gpu.ordinal.to_string(),
            selected,
            gpu.uuid.clone(),
            gpu.pci_bus_id.clone().unwrap_or_else(|| "-".to_string()),
            format_bytes(gpu.total_memory),
            format!("{}.{}", gpu.compute_capability.0, gpu.compute_capability.1),
            gpu.multiprocessors.to_string(),
            if mine.is_empty() { "(not visible: set_visible_devices)".to_string() } else { mine.join(", ") },
        ];
        if driver_memory {
            let free = match driver_memory_info(gpu.ordinal) {
                Ok(info) => format_bytes(info.free),
                Err(e) => format!("? ({e})"),
            };
            row.insert(5, free);
        }
        rows.push(row);
    }
    write_table(&mut out, &rows, 1);
    if topology.gpus.len() > 1 {
        out.push_str("Peer access (row can access column):\n");
        let mut rows = vec![std::iter::once(String::new())
            .chain(topology.gpus.iter().map(|g| g.ordinal.to_string()))
            .collect::<Vec<_>>()];
        for a in &topology.gpus {
            let mut row = vec![a.ordinal.to_string()];
            for b in &topology.gpus {
                row.push(if a.ordinal == b.ordinal {
                    "-".to_string()
                } else if topology.can_access_peer(a.ordinal, b.ordinal) {
                    "yes".to_string()
                } else {
                    "no".to_string()
                });
            }
            rows.push(row);
        }
        write_table(&mut out, &rows, 1);
    }
    Ok(out)
}

#[cfg(feature = "cuda")]
mod driver {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use cudarc::driver::sys::{CUdevice, CUdevice_attribute, CUresult};
    use cudarc::driver::{result, CudaContext};

    use super::{format_pci_bus_id, format_uuid, GpuInfo, GpuTopology};
    use crate::{Error, Result};

    /// `cuInit`, after the probe; `Ok(false)` when the driver reports no device.
    fn init() -> Result<bool> {
        crate::probe::driver()?;
        match result::init() {
            Ok(()) => Ok(true),
            Err(e) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => Ok(false),
            Err(e) => Err(Error::driver("cuInit")(e)),
        }
    }

    pub(super) fn count() -> Result<usize> {
        if !init()? {
            return Ok(0);
        }
        let n = result::device::get_count().map_err(Error::driver("cuDeviceGetCount"))?;
        Ok(n.max(0) as usize)
    }

    fn attribute(dev: CUdevice, attribute: CUdevice_attribute) -> Result<i32> {
        // SAFETY: `dev` comes from cuDeviceGet for an ordinal the driver listed; the call
        // writes one int and needs no context.
        unsafe { result::device::get_attribute(dev, attribute) }.map_err(Error::driver("cuDeviceGetAttribute"))
    }

    fn info(ordinal: u32) -> Result<(CUdevice, GpuInfo)> {
        let dev = result::device::get(ordinal as i32).map_err(Error::driver("cuDeviceGet"))?;
        let name = result::device::get_name(dev).map_err(Error::driver("cuDeviceGetName"))?;
        let uuid = result::device::get_uuid(dev).map_err(Error::driver("cuDeviceGetUuid"))?;
        let uuid = format_uuid(uuid.bytes.map(|b| b as u8));
        // SAFETY: as in `attribute`; cuDeviceTotalMem writes one size_t.
        let total = unsafe { result::device::total_mem(dev) }.map_err(Error::driver("cuDeviceTotalMem"))?;
        use CUdevice_attribute::*;
        let major = attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let pci = (|| {
            let domain = attribute(dev, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID).ok()?;
            let bus = attribute(dev, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID).ok()?;
            let device = attribute(dev, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID).ok()?;
            Some(format_pci_bus_id(domain as u32, bus as u32, device as u32))
        })();
        Ok((
            dev,
            GpuInfo {
                ordinal,
                name,
                uuid,
                total_memory: total as u64,
                compute_capability: (major.max(0) as u32, minor.max(0) as u32),
                multiprocessors: sms.max(0) as u32,
                pci_bus_id: pci,
            },
        ))
    }

    pub(super) fn discover() -> Result<GpuTopology> {
        let n = count()?;
        let mut devices = Vec::with_capacity(n);
        let mut gpus = Vec::with_capacity(n);
        for ordinal in 0..n as u32 {
            let (dev, gpu) = info(ordinal)?;
            devices.push(dev);
            gpus.push(gpu);
        }
        let mut topology = GpuTopology::new(gpus);
        for (a, &da) in devices.iter().enumerate() {
            for (b, &db) in devices.iter().enumerate() {
                if a == b {
                    continue;
                }
                let mut can: std::ffi::c_int = 0;
                // SAFETY: both handles come from cuDeviceGet for listed ordinals; the call
                // writes one int into `can` and needs no context.
                unsafe { cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can, da, db) }
                    .result()
                    .map_err(Error::driver("cuDeviceCanAccessPeer"))?;
                topology.peer_access[a][b] = can != 0;
            }
        }
        Ok(topology)
    }

    pub(super) fn context(ordinal: u32) -> Result<Arc<CudaContext>> {
        static CONTEXTS: OnceLock<Mutex<HashMap<u32, Arc<CudaContext>>>> = OnceLock::new();
        let contexts = CONTEXTS.get_or_init(Default::default);
        let mut contexts = contexts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ctx) = contexts.get(&ordinal) {
            return Ok(ctx.clone());
        }
        let n = count()?;
        if ordinal as usize >= n {
            let env = std::env::var(strata_core::device::CUDA_VISIBLE_DEVICES).ok();
            return Err(Error::NoGpu(format!(
                "no GPU with CUDA ordinal {ordinal}: the driver shows {n} GPU(s) to this process \
                 ({}={}); use an ordinal below {n}",
                strata_core::device::CUDA_VISIBLE_DEVICES,
                env.map_or_else(|| "unset".to_string(), |v| format!("{v:?}"))
            )));
        }
        let ctx = CudaContext::new(ordinal as usize).map_err(Error::driver("cuDevicePrimaryCtxRetain"))?;
        contexts.insert(ordinal, ctx.clone());
        Ok(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_and_pci_formats() {
        let bytes = [0x9a, 0x2b, 0x3c, 0x4d, 0x5e, 0x6f, 0x70, 0x81, 0x92, 0xa3, 0xb4, 0xc5, 0xd6, 0xe7, 0xf8, 0x09];
        assert_eq!(format_uuid(bytes), "GPU-9a2b3c4d-5e6f-7081-92a3-b4c5d6e7f809");
        assert_eq!(format_pci_bus_id(0, 0x17, 0), "00000000:17:00.0");
        assert_eq!(format_pci_bus_id(1, 0xcb, 0x1f), "00000001:CB:1F.0");
    }

    #[test]
    fn selecting_entries_follow_the_list() {
        assert_eq!(selecting_entries(None, 2), vec![None, None]);
        assert_eq!(
            selecting_entries(Some(" 3, GPU-ab ,x"), 2),
            vec![Some("3".to_string()), Some("GPU-ab".to_string())]
        );
    }
}

//! The device registry: which physical devices exist, which are visible, and the logical
//! devices they become (TensorFlow's `tf.config` device functions).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::logical::{split_physical, whole_device, LogicalDevice, LogicalDeviceConfiguration};
use super::physical::{CpuEnumerator, DeviceEnumerator, PhysicalDevice};
use super::spec::{DeviceSpec, DeviceType};
use super::visibility::{cuda_visible_devices_env, resolve_detailed, StoppedAt, VisibleDevices, CUDA_VISIBLE_DEVICES};
use crate::{Error, Result};

/// Where the registry takes `CUDA_VISIBLE_DEVICES` from.
#[derive(Clone, Debug)]
enum CudaEnv {
    /// The process environment, read when needed.
    Process,
    /// A fixed value (`None`: unset).
    Fixed(Option<String>),
}

struct Inner {
    enumerators: Vec<Box<dyn DeviceEnumerator>>,
    /// Physical devices per type, sorted by index, as enumerated.
    physical: HashMap<DeviceType, Vec<PhysicalDevice>>,
    cuda_env: CudaEnv,
    /// Visible devices set explicitly.
    visible: HashMap<DeviceType, VisibleDevices>,
    /// Logical configurations per physical device `(type, index)`.
    configs: HashMap<(DeviceType, u32), Vec<LogicalDeviceConfiguration>>,
    /// The logical devices, once initialized.
    logical: Option<Vec<LogicalDevice>>,
}

/// The devices of this process: enumerators of physical devices, the visible devices per
/// type, logical device configurations, and, once initialized, the logical devices.
///
/// Like TensorFlow, visibility and logical configurations can only change before the
/// devices are initialized, by [`DeviceRegistry::initialize`] or the first
/// [`DeviceRegistry::list_logical_devices`].
///
/// By default all CPUs are visible, and GPUs are those `CUDA_VISIBLE_DEVICES` selects (see
/// [`resolve_visible_devices`](super::resolve_visible_devices)), unless the GPU enumerator
/// [applies it itself](DeviceEnumerator::applies_cuda_visible_devices).
pub struct DeviceRegistry {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for DeviceRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("DeviceRegistry")
            .field("enumerators", &inner.enumerators.iter().map(|e| e.device_type()).collect::<Vec<_>>())
            .field("visible", &inner.visible)
            .field("configs", &inner.configs)
            .field("initialized", &inner.logical.is_some())
            .finish()
    }
}

impl Default for DeviceRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl DeviceRegistry {
    /// A registry with the [`CpuEnumerator`], reading `CUDA_VISIBLE_DEVICES` from the
    /// process environment.
    pub fn new() -> Self {
        DeviceRegistry {
            inner: Mutex::new(Inner {
                enumerators: vec![Box::new(CpuEnumerator)],
                physical: HashMap::new(),
                cuda_env: CudaEnv::Process,
                visible: HashMap::new(),
                configs: HashMap::new(),
                logical: None,
            }),
        }
    }

    /// This registry using `value` as `CUDA_VISIBLE_DEVICES` (`None`: unset) instead of the
    /// process environment: for tests, and to show what a value would select.
    pub fn with_cuda_visible_devices(mut self, value: Option<&str>) -> Self {
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        inner.cuda_env = CudaEnv::Fixed(value.map(str::to_string));
        self
    }

    /// The process-wide registry.
    pub fn global() -> &'static DeviceRegistry {
        static GLOBAL: OnceLock<DeviceRegistry> = OnceLock::new();
        GLOBAL.get_or_init(DeviceRegistry::new)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds an enumerator, replacing the one of the same device type. Refused once the
    /// devices are initialized.
    pub fn register_enumerator(&self, enumerator: Box<dyn DeviceEnumerator>) -> Result<()> {
        let mut inner = self.lock();
        let ty = enumerator.device_type();
        if inner.logical.is_some() {
            return Err(Error::InvalidArgument(format!(
                "a {ty} enumerator cannot be registered after the devices have been initialized; \
                 register it before listing logical devices"
            )));
        }
        inner.enumerators.retain(|e| e.device_type() != ty);
        inner.enumerators.push(enumerator);
        inner.physical.remove(&ty);
        Ok(())
    }

    /// Whether an enumerator of `device_type` is registered.
    pub fn has_enumerator(&self, device_type: DeviceType) -> bool {
        self.lock().enumerators.iter().any(|e| e.device_type() == device_type)
    }

    /// The physical devices of `device_type`, or of every type (CPUs first), sorted by index.
    /// A type without enumerator has no devices.
    pub fn list_physical_devices(&self, device_type: Option<DeviceType>) -> Result<Vec<PhysicalDevice>> {
        let mut inner = self.lock();
        let mut out = Vec::new();
        for ty in types(device_type) {
            out.extend(inner.physical_of(ty)?);
        }
        Ok(out)
    }

    /// Makes `devices`, in this order, the visible devices of `device_type` (position =
    /// logical index). Every device must be a physical device of that type, listed once; at
    /// least one CPU must stay visible. Refused once the devices are initialized.
    pub fn set_visible_devices(&self, devices: &[PhysicalDevice], device_type: DeviceType) -> Result<()> {
        if let Some(other) = devices.iter().find(|d| d.device_type != device_type) {
            return Err(Error::InvalidDeviceList(format!(
                "{} is not a {device_type} device; pass only {device_type} devices to set visible \
                 {device_type} devices",
                other.label()
            )));
        }
        self.set_visible_order(VisibleDevices::new(devices.iter().map(|d| d.index).collect()), device_type)
    }

    /// [`DeviceRegistry::set_visible_devices`] by physical indices.
    pub fn set_visible_order(&self, visible: VisibleDevices, device_type: DeviceType) -> Result<()> {
        let mut inner = self.lock();
        if inner.logical.is_some() {
            return Err(Error::InvalidDeviceList(
                "visible devices cannot be modified after the devices have been initialized; set them \
                 before listing logical devices"
                    .to_string(),
            ));
        }
        let physical = inner.physical_of(device_type)?;
        for (pos, &index) in visible.order.iter().enumerate() {
            if !physical.iter().any(|d| d.index == index) {
                return Err(Error::UnknownDevice(format!(
                    "{device_type} {index}: no such physical device (found {}); pick among them",
                    labels(&physical)
                )));
            }
            if visible.order[..pos].contains(&index) {
                return Err(Error::InvalidDeviceList(format!(
                    "{device_type} {index} is listed twice in the visible devices; list each device once"
                )));
            }
        }
        if device_type == DeviceType::Cpu && visible.is_empty() {
            return Err(Error::InvalidDeviceList(
                "at least one CPU device must stay visible; keep CPU 0 in the list".to_string(),
            ));
        }
        inner.visible.insert(device_type, visible);
        Ok(())
    }

    /// The visible physical devices of `device_type`, in logical order.
    pub fn get_visible_devices(&self, device_type: DeviceType) -> Result<Vec<PhysicalDevice>> {
        let mut inner = self.lock();
        let visible = inner.visible_of(device_type)?.0;
        let physical = inner.physical_of(device_type)?;
        visible.iter().map(|index| find(&physical, device_type, index).cloned()).collect()
    }

    /// The visible devices of `device_type` as physical indices in logical order.
    pub fn visible_devices(&self, device_type: DeviceType) -> Result<VisibleDevices> {
        Ok(self.lock().visible_of(device_type)?.0)
    }

    /// The value of `CUDA_VISIBLE_DEVICES` the registry uses (`None`: unset).
    pub fn cuda_visible_devices(&self) -> Result<Option<String>> {
        self.lock().cuda_env_value()
    }

    /// Whether the visible devices of `device_type` were set with
    /// [`DeviceRegistry::set_visible_devices`] (rather than coming from the defaults).
    pub fn visible_devices_overridden(&self, device_type: DeviceType) -> bool {
        self.lock().visible.contains_key(&device_type)
    }

    /// Why `CUDA_VISIBLE_DEVICES` stopped early, if it did and applies.
    pub(crate) fn cuda_visible_devices_stop(&self) -> Result<Option<StoppedAt>> {
        let mut inner = self.lock();
        Ok(inner.visible_of(DeviceType::Gpu)?.1)
    }

    /// Splits `physical` into the logical devices `configs` describe (see
    /// [`split_physical`] for the rules, checked now). The device must be a known physical
    /// device; a device that is not visible keeps its configuration but gets no logical
    /// device. Refused once the devices are initialized.
    pub fn set_logical_device_configuration(
        &self,
        physical: &PhysicalDevice,
        configs: Vec<LogicalDeviceConfiguration>,
    ) -> Result<()> {
        let mut inner = self.lock();
        if inner.logical.is_some() {
            return Err(Error::InvalidArgument(
                "logical devices cannot be configured after the devices have been initialized; \
                 configure them before listing logical devices"
                    .to_string(),
            ));
        }
        let ty = physical.device_type;
        let known = inner.physical_of(ty)?;
        let device = find(&known, ty, physical.index)?;
        split_physical(device, &configs, 0)?;
        inner.configs.insert((ty, physical.index), configs);
        Ok(())
    }

    /// The logical configuration of `physical`, if set.
    pub fn get_logical_device_configuration(
        &self,
        physical: &PhysicalDevice,
    ) -> Option<Vec<LogicalDeviceConfiguration>> {
        self.lock().configs.get(&(physical.device_type, physical.index)).cloned()
    }

    /// Removes the logical configuration of `physical` (it becomes one logical device again).
    /// Refused once the devices are initialized.
    pub fn clear_logical_device_configuration(&self, physical: &PhysicalDevice) -> Result<()> {
        let mut inner = self.lock();
        if inner.logical.is_some() {
            return Err(Error::InvalidArgument(
                "logical devices cannot be configured after the devices have been initialized; \
                 configure them before listing logical devices"
                    .to_string(),
            ));
        }
        inner.configs.remove(&(physical.device_type, physical.index));
        Ok(())
    }

    /// Creates the logical devices from the visible physical devices and their
    /// configurations, freezing both. Does nothing when already initialized.
    pub fn initialize(&self) -> Result<()> {
        let mut inner = self.lock();
        if inner.logical.is_none() {
            let logical = inner.compute_logical()?;
            tracing::debug!(
                "initialized {} logical devices: {}",
                logical.len(),
                logical.iter().map(|d| d.spec.to_string()).collect::<Vec<_>>().join(", ")
            );
            inner.logical = Some(logical);
        }
        Ok(())
    }

    /// Whether the devices are initialized.
    pub fn is_initialized(&self) -> bool {
        self.lock().logical.is_some()
    }

    /// The logical devices of `device_type`, or all (CPUs first), initializing the devices.
    ///
    /// Each visible physical device without configuration becomes one logical device (all its
    /// threads, or all its memory); one with a configuration becomes one device per entry.
    /// Indices count up per type in visible order.
    pub fn list_logical_devices(&self, device_type: Option<DeviceType>) -> Result<Vec<LogicalDevice>> {
        self.initialize()?;
        let inner = self.lock();
        let all = inner.logical.as_deref().unwrap_or_default();
        Ok(all.iter().filter(|d| device_type.is_none_or(|t| d.device_type() == t)).cloned().collect())
    }

    /// What [`DeviceRegistry::list_logical_devices`]`(None)` returns, without initializing
    /// (the devices as configured now).
    pub fn preview_logical_devices(&self) -> Result<Vec<LogicalDevice>> {
        let mut inner = self.lock();
        match &inner.logical {
            Some(logical) => Ok(logical.clone()),
            None => inner.compute_logical(),
        }
    }

    /// The logical device `spec` names (its device part, e.g. `/gpu:1`; job, replica and task
    /// are ignored), initializing the devices.
    pub fn logical_device(&self, spec: &DeviceSpec) -> Result<LogicalDevice> {
        let all = self.list_logical_devices(None)?;
        let pattern = spec.device_part();
        if pattern.device_type.is_none() || pattern.device_index.is_none() {
            return Err(Error::InvalidDeviceSpec {
                spec: spec.to_string(),
                reason: "name one device with a type and an index, such as /device:GPU:0".to_string(),
            });
        }
        all.iter().find(|d| d.spec.matches(&pattern)).cloned().ok_or_else(|| {
            let names: Vec<String> = all.iter().map(|d| d.spec.to_string()).collect();
            Error::UnknownDevice(format!(
                "{pattern}; the logical devices are {} (check {CUDA_VISIBLE_DEVICES} and the visible devices)",
                names.join(", ")
            ))
        })
    }
}

impl Inner {
    fn cuda_env_value(&self) -> Result<Option<String>> {
        match &self.cuda_env {
            CudaEnv::Process => cuda_visible_devices_env(),
            CudaEnv::Fixed(value) => Ok(value.clone()),
        }
    }

    /// The physical devices of `ty`, enumerated once and sorted by index.
    fn physical_of(&mut self, ty: DeviceType) -> Result<Vec<PhysicalDevice>> {
        if let Some(devices) = self.physical.get(&ty) {
            return Ok(devices.clone());
        }
        let mut devices = match self.enumerators.iter().find(|e| e.device_type() == ty) {
            Some(e) => e.physical_devices()?,
            None => Vec::new(),
        };
        devices.retain(|d| d.device_type == ty);
        devices.sort_by_key(|d| d.index);
        if let Some(w) = devices.windows(2).find(|w| w[0].index == w[1].index) {
            return Err(Error::InvalidDeviceList(format!(
                "the {ty} enumerator reported two devices with index {}; each device needs its own index",
                w[0].index
            )));
        }
        self.physical.insert(ty, devices.clone());
        Ok(devices)
    }

    /// The visible devices of `ty`, and where `CUDA_VISIBLE_DEVICES` stopped when it applies.
    fn visible_of(&mut self, ty: DeviceType) -> Result<(VisibleDevices, Option<StoppedAt>)> {
        if let Some(v) = self.visible.get(&ty) {
            return Ok((v.clone(), None));
        }
        let physical = self.physical_of(ty)?;
        if physical.is_empty() {
            // Nothing to select from (no GPU enumerator, or no GPU): nothing to warn about.
            return Ok((VisibleDevices::none(), None));
        }
        let env_applies = ty == DeviceType::Gpu
            && !self.enumerators.iter().any(|e| e.device_type() == ty && e.applies_cuda_visible_devices());
        if env_applies {
            let value = self.cuda_env_value()?;
            let (visible, stopped) = resolve_detailed(value.as_deref(), &physical)?;
            if let Some(stopped) = &stopped {
                tracing::warn!(
                    "{CUDA_VISIBLE_DEVICES}={:?}: {stopped}; using GPUs [{visible}]",
                    value.unwrap_or_default()
                );
            }
            Ok((visible, stopped))
        } else {
            Ok((VisibleDevices::all(&physical), None))
        }
    }

    fn compute_logical(&mut self) -> Result<Vec<LogicalDevice>> {
        let mut out = Vec::new();
        for ty in DeviceType::ALL {
            let (visible, _) = self.visible_of(ty)?;
            let physical = self.physical_of(ty)?;
            let mut next: u32 = 0;
            for index in visible.iter() {
                let device = find(&physical, ty, index)?;
                let devices = match self.configs.get(&(ty, index)) {
                    Some(configs) => split_physical(device, configs, next)?,
                    None => vec![whole_device(device, next)],
                };
                next = next
                    .checked_add(devices.len() as u32)
                    .ok_or_else(|| Error::InvalidDeviceList(format!("too many logical {ty} devices")))?;
                out.extend(devices);
            }
        }
        Ok(out)
    }
}

fn types(device_type: Option<DeviceType>) -> Vec<DeviceType> {
    device_type.map_or_else(|| DeviceType::ALL.to_vec(), |t| vec![t])
}

fn labels(devices: &[PhysicalDevice]) -> String {
    if devices.is_empty() {
        return "none".to_string();
    }
    devices.iter().map(PhysicalDevice::label).collect::<Vec<_>>().join(", ")
}

fn find(physical: &[PhysicalDevice], ty: DeviceType, index: u32) -> Result<&PhysicalDevice> {
    physical.iter().find(|d| d.index == index).ok_or_else(|| {
        Error::UnknownDevice(format!(
            "{ty} {index}: no such physical device (found {}); pick among them",
            labels(physical)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{LogicalKind, StaticEnumerator};

    const GIB: u64 = 1 << 30;

    fn registry(cuda: Option<&str>, gpus: u32) -> DeviceRegistry {
        let r = DeviceRegistry::new().with_cuda_visible_devices(cuda);
        if gpus > 0 {
            r.register_enumerator(Box::new(StaticEnumerator::fake_gpus(gpus, 16 * GIB))).unwrap();
        }
        r
    }

    fn specs(devices: &[LogicalDevice]) -> Vec<String> {
        devices.iter().map(|d| d.spec.to_string()).collect()
    }

    #[test]
    fn cpu_only_by_default() {
        let r = registry(None, 0);
        assert!(r.has_enumerator(DeviceType::Cpu));
        assert!(!r.has_enumerator(DeviceType::Gpu));
        let physical = r.list_physical_devices(None).unwrap();
        assert_eq!(physical.len(), 1);
        assert!(r.list_physical_devices(Some(DeviceType::Gpu)).unwrap().is_empty());
        assert!(!r.is_initialized());
        let logical = r.list_logical_devices(None).unwrap();
        assert!(r.is_initialized());
        assert_eq!(specs(&logical), ["/device:CPU:0"]);
        assert_eq!(logical[0].kind, LogicalKind::Cpu { threads: physical[0].cores.unwrap(), memory_limit: None });
    }

    #[test]
    fn gpus_follow_cuda_visible_devices() {
        let r = registry(Some("2,0"), 4);
        assert_eq!(r.cuda_visible_devices().unwrap().as_deref(), Some("2,0"));
        assert_eq!(r.list_physical_devices(Some(DeviceType::Gpu)).unwrap().len(), 4);
        assert_eq!(r.visible_devices(DeviceType::Gpu).unwrap().order, vec![2, 0]);
        let visible = r.get_visible_devices(DeviceType::Gpu).unwrap();
        assert_eq!(visible.iter().map(|d| d.index).collect::<Vec<_>>(), vec![2, 0]);
        let gpus = r.list_logical_devices(Some(DeviceType::Gpu)).unwrap();
        assert_eq!(specs(&gpus), ["/device:GPU:0", "/device:GPU:1"]);
        assert_eq!(gpus[0].physical.index, 2);
        assert_eq!(gpus[1].physical.index, 0);
        assert_eq!(r.list_logical_devices(None).unwrap().len(), 3);
        assert_eq!(r.logical_device(&"/gpu:1".parse().unwrap()).unwrap().physical.index, 0);
        assert!(!r.visible_devices_overridden(DeviceType::Gpu));
    }

    #[test]
    fn cuda_visible_devices_edge_cases() {
        assert!(registry(Some(""), 4).list_logical_devices(Some(DeviceType::Gpu)).unwrap().is_empty());
        assert_eq!(registry(None, 3).list_logical_devices(Some(DeviceType::Gpu)).unwrap().len(), 3);
        let stopped = registry(Some("1,x"), 3);
        assert_eq!(stopped.visible_devices(DeviceType::Gpu).unwrap().order, vec![1]);
        assert_eq!(stopped.cuda_visible_devices_stop().unwrap().unwrap().entry, "x");
        let err = registry(Some("1,1"), 3).list_logical_devices(None).unwrap_err();
        assert!(matches!(err, Error::InvalidDeviceList(_)), "{err:?}");
        assert!(!registry(Some("1,1"), 3).is_initialized());
        // The variable does not touch CPUs.
        assert_eq!(registry(Some("-1"), 2).list_logical_devices(Some(DeviceType::Cpu)).unwrap().len(), 1);
    }

    #[test]
    fn enumerators_that_apply_the_variable_are_not_filtered_twice() {
        let r = DeviceRegistry::new().with_cuda_visible_devices(Some("2,3"));
        let e = StaticEnumerator::fake_gpus(2, GIB).with_cuda_visible_devices_applied(true);
        r.register_enumerator(Box::new(e)).unwrap();
        assert_eq!(r.visible_devices(DeviceType::Gpu).unwrap().order, vec![0, 1]);
        assert_eq!(r.cuda_visible_devices_stop().unwrap(), None);
    }

    #[test]
    fn set_visible_devices_overrides_and_is_frozen_by_initialization() {
        let r = registry(Some("0,1,2,3"), 4);
        let gpus = r.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        r.set_visible_devices(&[gpus[3].clone(), gpus[1].clone()], DeviceType::Gpu).unwrap();
        assert!(r.visible_devices_overridden(DeviceType::Gpu));
        assert_eq!(r.visible_devices(DeviceType::Gpu).unwrap().order, vec![3, 1]);
        let logical = r.list_logical_devices(Some(DeviceType::Gpu)).unwrap();
        assert_eq!(logical.iter().map(|d| d.physical.index).collect::<Vec<_>>(), vec![3, 1]);

        let err = r.set_visible_devices(&gpus, DeviceType::Gpu).unwrap_err();
        assert!(matches!(err, Error::InvalidDeviceList(_)));
        assert!(err.to_string().contains("cannot be modified after the devices have been initialized"), "{err}");
        assert_eq!(r.visible_devices(DeviceType::Gpu).unwrap().order, vec![3, 1]);
        r.initialize().unwrap(); // idempotent
    }

    #[test]
    fn set_visible_devices_validates() {
        let r = registry(None, 2);
        let gpus = r.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        let cpu = r.list_physical_devices(Some(DeviceType::Cpu)).unwrap();

        let err = r.set_visible_devices(&cpu, DeviceType::Gpu).unwrap_err();
        assert!(err.to_string().contains("CPU 0 is not a GPU device"), "{err}");
        let err = r.set_visible_devices(&[gpus[0].clone(), gpus[0].clone()], DeviceType::Gpu).unwrap_err();
        assert!(err.to_string().contains("list each device once"), "{err}");
        let err = r.set_visible_order(VisibleDevices::new(vec![5]), DeviceType::Gpu).unwrap_err();
        assert!(matches!(err, Error::UnknownDevice(_)));
        assert!(err.to_string().contains("GPU 5") && err.to_string().contains("GPU 0, GPU 1"), "{err}");
        let err = r.set_visible_devices(&[], DeviceType::Cpu).unwrap_err();
        assert!(err.to_string().contains("at least one CPU"), "{err}");

        r.set_visible_devices(&[], DeviceType::Gpu).unwrap();
        assert!(r.get_visible_devices(DeviceType::Gpu).unwrap().is_empty());
        assert!(r.list_logical_devices(Some(DeviceType::Gpu)).unwrap().is_empty());
    }

    #[test]
    fn logical_configurations() {
        let r = registry(Some("1,0"), 2);
        let gpus = r.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        let cpu = r.list_physical_devices(Some(DeviceType::Cpu)).unwrap().remove(0);
        r.set_logical_device_configuration(&cpu, vec![LogicalDeviceConfiguration::cpu(1); 3]).unwrap();
        r.set_logical_device_configuration(
            &gpus[1],
            vec![LogicalDeviceConfiguration::gpu(4 * GIB), LogicalDeviceConfiguration::gpu(8 * GIB)],
        )
        .unwrap();
        assert_eq!(r.get_logical_device_configuration(&gpus[1]).unwrap().len(), 2);
        assert_eq!(r.get_logical_device_configuration(&gpus[0]), None);

        // Invalid configurations are refused when set.
        let err = r.set_logical_device_configuration(&gpus[0], vec![LogicalDeviceConfiguration::gpu(17 * GIB)]);
        assert!(matches!(err, Err(Error::InvalidMemoryConfig(_))));
        assert!(r.set_logical_device_configuration(&gpus[0], vec![]).is_err());
        let mut ghost = gpus[0].clone();
        ghost.index = 9;
        let err = r.set_logical_device_configuration(&ghost, vec![LogicalDeviceConfiguration::gpu(1)]);
        assert!(matches!(err, Err(Error::UnknownDevice(_))));

        let preview = r.preview_logical_devices().unwrap();
        assert!(!r.is_initialized(), "preview does not initialize");
        let logical = r.list_logical_devices(None).unwrap();
        assert_eq!(preview, logical);
        assert_eq!(
            specs(&logical),
            ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2", "/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]
        );
        // GPU 1 is logical first (CUDA_VISIBLE_DEVICES=1,0) and split in two.
        let phys: Vec<u32> = logical[3..].iter().map(|d| d.physical.index).collect();
        assert_eq!(phys, vec![1, 1, 0]);
        assert_eq!(logical[4].kind, LogicalKind::Gpu { memory_limit: Some(8 * GIB) });
        assert_eq!(logical[5].kind, LogicalKind::Gpu { memory_limit: None });

        let err = r.set_logical_device_configuration(&gpus[0], vec![LogicalDeviceConfiguration::gpu(1)]);
        assert!(err.unwrap_err().to_string().contains("after the devices have been initialized"));
        assert!(r.clear_logical_device_configuration(&gpus[1]).is_err());
        assert!(r.register_enumerator(Box::new(StaticEnumerator::fake_gpus(1, 1))).is_err());
    }

    #[test]
    fn clear_configuration_and_invisible_configured_devices() {
        let r = registry(Some("0"), 2);
        let gpus = r.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        r.set_logical_device_configuration(&gpus[1], vec![LogicalDeviceConfiguration::gpu(GIB)]).unwrap();
        r.set_logical_device_configuration(&gpus[0], vec![LogicalDeviceConfiguration::gpu(GIB); 2]).unwrap();
        r.clear_logical_device_configuration(&gpus[0]).unwrap();
        let logical = r.list_logical_devices(Some(DeviceType::Gpu)).unwrap();
        assert_eq!(logical.len(), 1, "GPU 1 is configured but not visible");
        assert_eq!(logical[0].physical.index, 0);
    }

    #[test]
    fn logical_device_lookup() {
        let r = registry(None, 1);
        assert_eq!(r.logical_device(&DeviceSpec::cpu(0)).unwrap().spec, DeviceSpec::cpu(0));
        let with_job: DeviceSpec = "/job:localhost/replica:0/task:0/device:GPU:0".parse().unwrap();
        assert_eq!(r.logical_device(&with_job).unwrap().spec, DeviceSpec::gpu(0));
        let err = r.logical_device(&DeviceSpec::gpu(3)).unwrap_err();
        assert!(matches!(err, Error::UnknownDevice(_)));
        assert!(err.to_string().contains("/device:CPU:0, /device:GPU:0"), "{err}");
        assert!(r.logical_device(&"/gpu:*".parse().unwrap()).is_err());
    }

    #[test]
    fn register_enumerator_replaces_and_rescans() {
        let r = registry(None, 2);
        assert_eq!(r.list_physical_devices(Some(DeviceType::Gpu)).unwrap().len(), 2);
        r.register_enumerator(Box::new(StaticEnumerator::fake_gpus(5, GIB))).unwrap();
        assert_eq!(r.list_physical_devices(Some(DeviceType::Gpu)).unwrap().len(), 5);
        let fake_cpu = PhysicalDevice {
            index: 0,
            device_type: DeviceType::Cpu,
            name: "fake".into(),
            uuid: None,
            memory_bytes: None,
            compute_capability: None,
            cores: Some(3),
        };
        r.register_enumerator(Box::new(StaticEnumerator::new(DeviceType::Cpu, vec![fake_cpu.clone()]))).unwrap();
        assert_eq!(r.list_physical_devices(None).unwrap()[0], fake_cpu);
        let logical = r.list_logical_devices(Some(DeviceType::Cpu)).unwrap();
        assert_eq!(logical[0].kind, LogicalKind::Cpu { threads: 3, memory_limit: None });
    }

    #[test]
    fn duplicate_physical_indices_are_refused() {
        let r = DeviceRegistry::new().with_cuda_visible_devices(None);
        let mut gpus = StaticEnumerator::fake_gpus(2, GIB).physical_devices().unwrap();
        gpus[1].index = 0;
        r.register_enumerator(Box::new(StaticEnumerator::new(DeviceType::Gpu, gpus))).unwrap();
        let err = r.list_physical_devices(None).unwrap_err();
        assert!(err.to_string().contains("two devices with index 0"), "{err}");
    }

    #[test]
    fn global_registry_is_shared() {
        assert!(std::ptr::eq(DeviceRegistry::global(), DeviceRegistry::global()));
        assert!(DeviceRegistry::global().has_enumerator(DeviceType::Cpu));
        assert!(format!("{:?}", DeviceRegistry::new()).contains("initialized: false"));
    }

    #[test]
    fn no_gpus_ignores_the_variable() {
        let r = registry(Some("3,x"), 0);
        assert!(r.visible_devices(DeviceType::Gpu).unwrap().is_empty());
        assert_eq!(r.cuda_visible_devices_stop().unwrap(), None);
    }
}

//! Devices: names, physical and logical devices, visibility and memory.
//!
//! ```
//! use strata_core::device::{
//!     logical_cpus, resolve_visible_devices, DeviceRegistry, DeviceSpec, DeviceType,
//!     MemoryPolicy, StaticEnumerator,
//! };
//!
//! // Device names in TensorFlow's form.
//! let spec: DeviceSpec = "/job:worker/task:1/gpu:0".parse()?;
//! assert_eq!(spec.to_string(), "/job:worker/task:1/device:GPU:0");
//! assert!(spec.is_gpu() && spec.matches(&DeviceSpec::gpu(0)));
//!
//! // CUDA_VISIBLE_DEVICES as a pure function: logical GPU 0 is physical GPU 2.
//! let gpus = StaticEnumerator::fake_gpus(4, 16 << 30);
//! let registry = DeviceRegistry::new().with_cuda_visible_devices(Some("2,3"));
//! registry.register_enumerator(Box::new(gpus))?;
//! let physical = registry.list_physical_devices(Some(DeviceType::Gpu))?;
//! let visible = resolve_visible_devices(Some("2,3"), &physical)?;
//! assert_eq!(visible.physical_of(0), Some(2));
//! let logical = registry.list_logical_devices(Some(DeviceType::Gpu))?;
//! assert_eq!(logical[1].physical.index, 3);
//!
//! // Several replicas on one CPU, and a memory policy.
//! assert_eq!(logical_cpus(2)?.len(), 2);
//! let policy: MemoryPolicy = "limit:4GiB".parse()?;
//! assert_eq!(policy.budget(Some(16 << 30))?, Some(4 << 30));
//! # Ok::<(), strata_core::Error>(())
//! ```
//!
//! * [`DeviceSpec`] / [`DeviceType`]: `/job:worker/replica:0/task:1/device:GPU:0` and its
//!   short forms.
//! * [`PhysicalDevice`] and the [`DeviceEnumerator`]s that find them ([`CpuEnumerator`]
//!   here; GPU enumerators come from the CUDA backend).
//! * [`LogicalDevice`]s: a physical device split by [`LogicalDeviceConfiguration`]s
//!   ([`split_physical`], [`logical_cpus`]).
//! * [`DeviceRegistry`]: the `tf.config` device functions (visible devices, logical
//!   configurations, initialization).
//! * [`resolve_visible_devices`]: the rules of `CUDA_VISIBLE_DEVICES`.
//! * [`MemoryPolicy`] and [`MemoryTracker`]: how much memory Strata may use, and uses.
//! * [`describe_devices`]: the report `strata devices` prints.
//! * [`candle_device`]: the candle device a logical device computes on.

mod candle;
mod describe;
mod logical;
mod memory;
mod physical;
mod registry;
mod spec;
mod visibility;

pub use candle::candle_device;
pub use describe::{describe_devices, write_table};
pub use logical::{
    check_replicas, logical_cpus, split_physical, LogicalDevice, LogicalDeviceConfiguration, LogicalKind, MAX_REPLICAS,
};
pub use memory::{format_bytes, memory_info, parse_bytes, MemoryInfo, MemoryPolicy, MemoryTracker};
pub use physical::{CpuEnumerator, DeviceEnumerator, PhysicalDevice, StaticEnumerator};
pub use registry::DeviceRegistry;
pub use spec::{DeviceSpec, DeviceType};
pub use visibility::{
    cuda_visible_devices_env, resolve_visible_devices, visible_devices_from_env, VisibleDevices, CUDA_VISIBLE_DEVICES,
};

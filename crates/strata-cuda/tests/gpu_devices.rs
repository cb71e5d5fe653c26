//! GPU devices: the enumerator and `CUDA_VISIBLE_DEVICES` composed on CPU with fake GPU lists,
//! then (feature `cuda`, gated by `require_gpus`) discovery, memory limits and `memory_info`
//! on real GPUs.

use strata_core::device::{
    DeviceEnumerator, DeviceRegistry, DeviceType, LogicalDevice, PhysicalDevice, StaticEnumerator,
};
use strata_cuda::device::{describe_gpus, CudaEnumerator, GpuTopology};

const GIB: u64 = 1 << 30;

/// Four GPUs as a machine shows them with the variable unset, with distinct UUIDs.
fn machine() -> Vec<PhysicalDevice> {
    StaticEnumerator::fake_gpus(4, 16 * GIB).physical_devices().unwrap()
}

fn uuids(devices: &[LogicalDevice]) -> Vec<String> {
    devices.iter().map(|d| d.physical.uuid.clone().unwrap()).collect()
}

/// The logical GPUs of a process started with `CUDA_VISIBLE_DEVICES=value`, narrowed by
/// `set_visible` (indices into what the process sees), both ways: (a) the driver applies the
/// variable and the CudaEnumerator reports its view; (b) strata-core applies it to the full
/// list.
fn both_routes(value: Option<&str>, set_visible: Option<&[usize]>) -> (Vec<String>, Vec<String>) {
    // (a) the driver's view.
    let driver_view = GpuTopology::as_driver_shows(&machine(), value).unwrap();
    let a = DeviceRegistry::new().with_cuda_visible_devices(value);
    let enumerator = CudaEnumerator::from_topology(driver_view, true);
    assert!(enumerator.applies_cuda_visible_devices());
    a.register_enumerator(Box::new(enumerator)).unwrap();
    // (b) strata-core's rules on the full list.
    let b = DeviceRegistry::new().with_cuda_visible_devices(value);
    b.register_enumerator(Box::new(StaticEnumerator::fake_gpus(4, 16 * GIB))).unwrap();
    if let Some(picks) = set_visible {
        for r in [&a, &b] {
            let visible = r.get_visible_devices(DeviceType::Gpu).unwrap();
            let chosen: Vec<PhysicalDevice> = picks.iter().map(|&i| visible[i].clone()).collect();
            r.set_visible_devices(&chosen, DeviceType::Gpu).unwrap();
        }
    }
    let la = a.list_logical_devices(Some(DeviceType::Gpu)).unwrap();
    let lb = b.list_logical_devices(Some(DeviceType::Gpu)).unwrap();
    (uuids(&la), uuids(&lb))
}

fn uuid(i: u32) -> String {
    format!("GPU-{i:08x}-0000-0000-0000-000000000000")
}

#[test]
fn driver_view_and_core_rules_agree() {
    let cases: [(Option<&str>, Vec<u32>); 7] = [
        (None, vec![0, 1, 2, 3]),
        (Some("2,3"), vec![2, 3]),
        (Some("3,1"), vec![3, 1]),
        (Some("1,x,3"), vec![1]),
        (Some("GPU-00000002,0"), vec![2, 0]),
        (Some("-1"), vec![]),
        (Some(""), vec![]),
    ];
    for (value, expected) in cases {
        let (a, b) = both_routes(value, None);
        let expected: Vec<String> = expected.into_iter().map(uuid).collect();
        assert_eq!(a, expected, "driver route, CUDA_VISIBLE_DEVICES={value:?}");
        assert_eq!(b, expected, "core route, CUDA_VISIBLE_DEVICES={value:?}");
    }
}

#[test]
fn set_visible_devices_narrows_the_drivers_list() {
    // The process sees physical 3 and 1 as ordinals 0 and 1; keep the second, then reorder.
    let (a, b) = both_routes(Some("3,1"), Some(&[1]));
    assert_eq!(a, vec![uuid(1)]);
    assert_eq!(a, b);
    let (a, b) = both_routes(Some("0,2,3"), Some(&[2, 0]));
    assert_eq!(a, vec![uuid(3), uuid(0)]);
    assert_eq!(a, b);
}

#[test]
fn the_driver_view_is_renumbered_and_not_filtered_twice() {
    let view = GpuTopology::as_driver_shows(&machine(), Some("2,3")).unwrap();
    let ordinals: Vec<u32> = view.gpus.iter().map(|g| g.ordinal).collect();
    assert_eq!(ordinals, vec![0, 1]);
    assert_eq!(view.gpus[0].uuid, uuid(2));
    let r = DeviceRegistry::new().with_cuda_visible_devices(Some("2,3"));
    r.register_enumerator(Box::new(CudaEnumerator::from_topology(view, true))).unwrap();
    let logical = r.list_logical_devices(Some(DeviceType::Gpu)).unwrap();
    // Logical GPU i is CUDA ordinal i, the index every CUDA call takes.
    assert_eq!(logical.iter().map(|d| d.physical.index).collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(logical[1].physical.memory_bytes, Some(16 * GIB));

    // The same list, not marked as filtered, is filtered again (and loses GPUs): the flag
    // matters.
    let view = GpuTopology::as_driver_shows(&machine(), Some("2,3")).unwrap();
    let r = DeviceRegistry::new().with_cuda_visible_devices(Some("2,3"));
    r.register_enumerator(Box::new(CudaEnumerator::from_topology(view, false))).unwrap();
    assert!(r.list_logical_devices(Some(DeviceType::Gpu)).unwrap().is_empty());

    assert!(GpuTopology::as_driver_shows(&machine(), Some("1,1")).is_err());
}

#[test]
fn the_driver_enumerator_says_it_applies_the_variable() {
    assert!(CudaEnumerator::new().applies_cuda_visible_devices());
    assert_eq!(CudaEnumerator::new().device_type(), DeviceType::Gpu);
}

#[test]
fn describe_shows_the_mapping_and_peer_access() {
    let mut view = GpuTopology::as_driver_shows(&machine(), Some("3, GPU-00000001")).unwrap();
    view.peer_access[0][1] = true;
    let r = DeviceRegistry::new().with_cuda_visible_devices(Some("3, GPU-00000001"));
    r.register_enumerator(Box::new(CudaEnumerator::from_topology(view.clone(), true))).unwrap();
    let text = describe_gpus(&r, &view, false).unwrap();
    assert!(text.contains("CUDA_VISIBLE_DEVICES entry \"3\""), "{text}");
    assert!(text.contains("CUDA_VISIBLE_DEVICES entry \"GPU-00000001\""), "{text}");
    assert!(text.contains(&uuid(3)) && text.contains("16.0 GiB") && text.contains("/device:GPU:1"), "{text}");
    assert!(text.contains("Peer access (row can access column):"), "{text}");
    let rows: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("Peer access")).skip(2).collect();
    assert_eq!(rows[0].split_whitespace().collect::<Vec<_>>(), ["0", "-", "yes"], "{text}");
    assert_eq!(rows[1].split_whitespace().collect::<Vec<_>>(), ["1", "no", "-"], "{text}");
    assert!(view.can_access_peer(0, 1) && !view.can_access_peer(1, 0) && !view.can_access_peer(0, 0));
    assert!(!view.all_peers(&[0, 1]) && view.all_peers(&[1]));
    assert!(text.lines().all(|l| l == l.trim_end()), "no trailing spaces:\n{text}");

    let empty = describe_gpus(&DeviceRegistry::new(), &GpuTopology::default(), false).unwrap();
    assert!(empty.contains("none"), "{empty}");
}

#[test]
fn without_a_driver_discovery_is_an_error_and_the_enumerator_lists_nothing() {
    if strata_cuda::probe::driver().is_ok() {
        return; // a machine with a driver: covered by the GPU tests below
    }
    let err = strata_cuda::device::discover().unwrap_err().to_string();
    assert!(err.contains("not on the library path") || err.contains("rebuild with"), "{err}");
    assert!(CudaEnumerator::new().physical_devices().unwrap().is_empty());
    assert!(strata_cuda::device::register_cuda_enumerator(&DeviceRegistry::new()).is_err());
    assert!(strata_cuda::device::driver_memory_info(0).is_err());
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use strata_core::device::{LogicalDeviceConfiguration, MemoryPolicy, MemoryTracker};
    use strata_cuda::alloc::{round_size, GpuAllocators};
    use strata_cuda::device::{discover, driver_memory_info, gpu_count};
    use strata_cuda::testing::require_gpus;
    use strata_cuda::Error;

    const MIB: u64 = 1 << 20;

    fn tracker() -> &'static MemoryTracker {
        Box::leak(Box::new(MemoryTracker::new()))
    }

    fn is_uuid(s: &str) -> bool {
        let Some(rest) = s.strip_prefix("GPU-") else { return false };
        let groups: Vec<&str> = rest.split('-').collect();
        groups.iter().map(|g| g.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
            && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
    }

    #[test]
    fn discovery_returns_sane_values() {
        if !require_gpus(1) {
            return;
        }
        let topology = discover().unwrap();
        assert_eq!(topology.gpus.len(), gpu_count().unwrap());
        for (i, gpu) in topology.gpus.iter().enumerate() {
            assert_eq!(gpu.ordinal as usize, i);
            assert!(!gpu.name.is_empty(), "{gpu:?}");
            assert!(is_uuid(&gpu.uuid), "{gpu:?}");
            assert!(gpu.total_memory >= GIB, "{gpu:?}");
            assert!(gpu.compute_capability.0 >= 5, "{gpu:?}");
            assert!(gpu.multiprocessors >= 1, "{gpu:?}");
            if let Some(pci) = &gpu.pci_bus_id {
                assert_eq!(pci.len(), "00000000:17:00.0".len(), "{gpu:?}");
            }
        }
        let n = topology.gpus.len();
        assert_eq!(topology.peer_access.len(), n);
        for a in 0..n {
            assert!(!topology.peer_access[a][a]);
        }
        let mut unique: Vec<&str> = topology.gpus.iter().map(|g| g.uuid.as_str()).collect();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), n, "UUIDs are distinct");

        let registry = DeviceRegistry::new();
        strata_cuda::device::register_cuda_enumerator(&registry).unwrap();
        let physical = registry.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        assert_eq!(physical, topology.physical_devices());
        assert_eq!(registry.list_logical_devices(Some(DeviceType::Gpu)).unwrap().len(), n);

        let info = driver_memory_info(0).unwrap();
        assert_eq!(info.total, topology.gpus[0].total_memory);
        assert!(info.free <= info.total);
    }

    #[test]
    fn a_logical_gpus_memory_limit_is_enforced_and_memory_info_matches() {
        if !require_gpus(1) {
            return;
        }
        let registry = DeviceRegistry::new();
        strata_cuda::device::register_cuda_enumerator(&registry).unwrap();
        let gpus = registry.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
        registry
            .set_logical_device_configuration(
                &gpus[0],
                vec![LogicalDeviceConfiguration::gpu(64 * MIB), LogicalDeviceConfiguration::gpu(128 * MIB)],
            )
            .unwrap();
        let logical = registry.list_logical_devices(Some(DeviceType::Gpu)).unwrap();
        let t = tracker();
        let allocators = GpuAllocators::with_tracker(&logical, MemoryPolicy::Growth, t).unwrap();
        let g0 = allocators.pool(&logical[0].spec).unwrap();
        let g1 = allocators.pool(&logical[1].spec).unwrap();
        assert_eq!((g0.ordinal(), g1.ordinal()), (0, 0));

        // 48 MiB of f32 holding a pattern, read back.
        let n = (48 * MIB / 4) as usize;
        let host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
        let a = g0.clone_htod(&host).unwrap();
        let back = g0.stream().unwrap().clone_dtoh(&*a).unwrap();
        assert_eq!(back, host);
        assert_eq!(t.memory_info(&logical[0].spec).current, 48 * MIB);

        // 32 MiB more is past GPU:0's 64 MiB.
        // SAFETY: the allocation is refused; nothing is read.
        let err = unsafe { g0.alloc::<f32>((32 * MIB / 4) as usize) }.unwrap_err();
        match &err {
            Error::MemoryLimit { requested, in_use, limit, .. } => {
                assert_eq!((*requested, *in_use, *limit), (32 * MIB, 48 * MIB, 64 * MIB))
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("raise memory_limit"), "{err}");

        // GPU:1, on the same physical GPU, has its own 128 MiB.
        let b = g1.alloc_zeros::<u8>((96 * MIB) as usize).unwrap();
        let zeros = g1.stream().unwrap().clone_dtoh(&*b).unwrap();
        assert!(zeros.iter().all(|&z| z == 0));
        assert_eq!(t.memory_info(&logical[1].spec).current, 96 * MIB);
        let odd = g1.alloc_zeros::<u8>(1000).unwrap();
        assert_eq!(t.memory_info(&logical[1].spec).current, 96 * MIB + round_size(1000).unwrap());

        drop((a, b, odd));
        let info = t.memory_info(&logical[0].spec);
        assert_eq!((info.current, info.peak), (0, 48 * MIB));
        // The freed block is reused: no new cuMemAlloc.
        let before = g0.stats().backend_allocations;
        let c = g0.alloc_zeros::<f32>(n).unwrap();
        assert_eq!(g0.stats().backend_allocations, before);
        assert_eq!(g0.stats().cache_hits, 1);
        drop(c);
        assert_eq!(g0.empty_cache().unwrap(), 48 * MIB);
    }

    #[test]
    fn a_reservation_is_one_allocation_and_the_policy_limit_holds() {
        if !require_gpus(1) {
            return;
        }
        let topology = discover().unwrap();
        let device = strata_core::device::LogicalDevice {
            spec: strata_core::device::DeviceSpec::gpu(0),
            physical: topology.gpus[0].to_physical(),
            kind: strata_core::device::LogicalKind::Gpu { memory_limit: None },
        };
        let t = tracker();
        let allocators = GpuAllocators::with_tracker(&[device], MemoryPolicy::Limit(256 * MIB), t).unwrap();
        let pool = allocators.pool(&strata_core::device::DeviceSpec::gpu(0)).unwrap();
        let buffers: Vec<_> = (0..16).map(|_| pool.alloc_zeros::<f32>((4 * MIB / 4) as usize).unwrap()).collect();
        let s = pool.stats();
        assert_eq!((s.backend_allocations, s.held, s.in_use), (1, 256 * MIB, 64 * MIB));
        let err = pool.alloc_zeros::<u8>((200 * MIB) as usize).unwrap_err();
        assert!(
            matches!(err, Error::MemoryLimit { in_use, limit, .. } if in_use == 64 * MIB && limit == 256 * MIB),
            "{err}"
        );
        drop(buffers);
        assert_eq!(t.memory_info(&strata_core::device::DeviceSpec::gpu(0)).current, 0);
    }
}

//! The caching allocator's policy on CPU, over a simulated device that counts the backend's
//! allocations and frees.

use strata_core::device::{
    DeviceRegistry, DeviceSpec, DeviceType, LogicalDeviceConfiguration, MemoryPolicy, MemoryTracker, StaticEnumerator,
};
use strata_cuda::alloc::{
    round_size, DevicePools, LimitSource, Pool, PoolConfig, PoolMode, Reservation, SimulatedBackend, SimulatedStats,
    GRANULE,
};
use strata_cuda::Error;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn tracker() -> &'static MemoryTracker {
    Box::leak(Box::new(MemoryTracker::new()))
}

fn pool(
    policy: MemoryPolicy,
    memory_limit: Option<u64>,
    total: Option<u64>,
    capacity: u64,
) -> (Pool<SimulatedBackend>, SimulatedBackend, &'static MemoryTracker) {
    let t = tracker();
    let config = PoolConfig::resolve(DeviceSpec::gpu(0), "GPU 0", policy, memory_limit, total).unwrap().with_tracker(t);
    let backend = SimulatedBackend::new(capacity);
    (Pool::new(config, backend.clone()), backend, t)
}

fn sim(allocations: u64, frees: u64, allocated: u64) -> (u64, u64, u64) {
    (allocations, frees, allocated)
}

fn counts(b: &SimulatedBackend) -> (u64, u64, u64) {
    let SimulatedStats { allocations, frees, allocated, .. } = b.stats();
    (allocations, frees, allocated)
}

#[test]
fn config_resolution() {
    let d = DeviceSpec::gpu(0);
    let c = |p, l, t| PoolConfig::resolve(d.clone(), "GPU 0", p, l, t).unwrap();
    let growth = c(MemoryPolicy::Growth, None, Some(MIB));
    assert_eq!((growth.mode, growth.limit, growth.limit_source), (PoolMode::Growth, Some(MIB), LimitSource::Device));
    let all = c(MemoryPolicy::GrabAll, None, Some(MIB));
    assert_eq!((all.mode, all.limit), (PoolMode::Reserve(Reservation::FreeMemory), Some(MIB)));
    let limit = c(MemoryPolicy::Limit(100_000), None, Some(MIB));
    // The reservation is whole blocks; the limit is exact.
    assert_eq!((limit.mode, limit.limit), (PoolMode::Reserve(Reservation::Bytes(99_840)), Some(100_000)));
    let logical = c(MemoryPolicy::Growth, Some(256 * KIB), Some(MIB));
    assert_eq!(
        (logical.mode, logical.limit, logical.limit_source),
        (PoolMode::Growth, Some(256 * KIB), LimitSource::LogicalDevice)
    );
    let logical = c(MemoryPolicy::Fraction(0.9), Some(256 * KIB), Some(MIB));
    assert_eq!(
        logical.mode,
        PoolMode::Reserve(Reservation::Bytes(256 * KIB)),
        "memory_limit overrides the policy's size"
    );

    let err = PoolConfig::resolve(d.clone(), "GPU 0", MemoryPolicy::Limit(2 * MIB), None, Some(MIB)).unwrap_err();
    assert!(err.to_string().contains("/device:GPU:0: memory limit 2.0 MiB exceeds the device's 1.0 MiB"), "{err}");
    let err = PoolConfig::resolve(d.clone(), "GPU 0", MemoryPolicy::Fraction(0.5), None, None).unwrap_err();
    assert!(err.to_string().contains("unknown"), "{err}");
    let err = PoolConfig::resolve(d.clone(), "GPU 0", MemoryPolicy::Limit(100), None, None).unwrap_err();
    assert!(err.to_string().contains("less than one block of 512"), "{err}");
    assert!(PoolConfig::resolve(d, "GPU 0", MemoryPolicy::Growth, Some(0), None).is_err());
}

#[test]
fn growth_reuses_cached_blocks() {
    let (pool, backend, t) = pool(MemoryPolicy::Growth, None, Some(MIB), MIB);
    let blocks: Vec<_> = (0..3).map(|_| pool.allocate(1000).unwrap()).collect();
    assert_eq!(counts(&backend), sim(3, 0, 3 * 1024));
    assert!(blocks.iter().all(|b| b.size() == 1024 && b.requested() == 1000));
    let addresses: Vec<u64> = blocks.iter().map(|b| b.address()).collect();
    drop(blocks);
    assert_eq!(pool.stats().cached, 3 * 1024);
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)).current, 0);

    // The same size class again: no backend allocation.
    let again: Vec<_> = (0..3).map(|_| pool.allocate(900).unwrap()).collect();
    assert_eq!(counts(&backend), sim(3, 0, 3 * 1024));
    let mut reused: Vec<u64> = again.iter().map(|b| b.address()).collect();
    reused.sort_unstable();
    let mut expected = addresses.clone();
    expected.sort_unstable();
    assert_eq!(reused, expected);
    let s = pool.stats();
    assert_eq!((s.cache_hits, s.backend_allocations, s.cached, s.in_use), (3, 3, 0, 3 * 1024));

    // Another size class: a new block.
    let big = pool.allocate(5000).unwrap();
    assert_eq!(big.size(), 5120);
    assert_eq!(counts(&backend), sim(4, 0, 3 * 1024 + 5120));
    drop(big);
    // A cached block at most 1/8 larger serves a smaller request: 5120 <= 4608 + 576.
    let near = pool.allocate(4608).unwrap();
    assert_eq!((near.size(), pool.stats().backend_allocations), (5120, 4));
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)).current, 3 * 1024 + 5120);
    drop(near);
    // ... but not a request more than 1/8 smaller.
    let small = pool.allocate(4096).unwrap();
    assert_eq!((small.size(), pool.stats().backend_allocations), (4096, 5));
    drop((again, small));

    assert_eq!(pool.empty_cache().unwrap(), 3 * 1024 + 5120 + 4096);
    assert_eq!(counts(&backend), sim(5, 5, 0));
}

#[test]
fn freeing_returns_blocks_and_dropping_the_pool_frees_everything() {
    let (pool, backend, t) = pool(MemoryPolicy::Growth, None, None, MIB);
    let a = pool.allocate(3 * KIB).unwrap();
    let b = pool.allocate(KIB).unwrap();
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)).current, 4 * KIB);
    drop(a);
    let s = pool.stats();
    assert_eq!((s.in_use, s.cached, s.held, s.buffers), (KIB, 3 * KIB, 4 * KIB, 1));
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)).current, KIB);
    drop(pool); // `b` keeps the pool alive
    assert_eq!(counts(&backend), sim(2, 0, 4 * KIB));
    drop(b);
    assert_eq!(counts(&backend), sim(2, 2, 0));
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)), strata_core::device::MemoryInfo { current: 0, peak: 4 * KIB });
}

#[test]
fn reservation_makes_one_backend_allocation() {
    let (pool, backend, t) = pool(MemoryPolicy::Limit(MIB), None, Some(4 * MIB), 4 * MIB);
    assert_eq!(counts(&backend), sim(0, 0, 0), "nothing reserved before the first allocation");
    let blocks: Vec<_> = (0..100).map(|i| pool.allocate(1000 + i).unwrap()).collect();
    assert_eq!(counts(&backend), sim(1, 0, MIB));
    // Sub-allocated back to back from the reservation.
    for w in blocks.windows(2) {
        assert_eq!(w[1].address(), w[0].address() + w[0].size());
    }
    let in_use: u64 = blocks.iter().map(|b| b.size()).sum();
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)).current, in_use);
    let s = pool.stats();
    assert_eq!((s.held, s.in_use, s.cached, s.backend_allocations), (MIB, in_use, MIB - in_use, 1));
    drop(blocks);
    assert_eq!(pool.stats().cached, MIB);
    // The whole reservation is one free range again.
    let whole = pool.allocate(MIB).unwrap();
    assert_eq!(counts(&backend), sim(1, 0, MIB));
    drop(whole);
    assert_eq!(pool.empty_cache().unwrap(), MIB);
    assert_eq!(counts(&backend), sim(1, 1, 0));
    let _again = pool.allocate(1).unwrap();
    assert_eq!(counts(&backend), sim(2, 1, MIB), "reserved again");
}

#[test]
fn limit_is_enforced_with_exact_bytes() {
    let t = tracker();
    let device: DeviceSpec = "/device:GPU:1".parse().unwrap();
    let config = PoolConfig::resolve(device.clone(), "GPU 0", MemoryPolicy::Growth, Some(10_000), Some(MIB))
        .unwrap()
        .with_tracker(t);
    let backend = SimulatedBackend::new(MIB);
    let pool = Pool::new(config, backend.clone());
    let a = pool.allocate(8192).unwrap();
    let err = pool.allocate(2000).unwrap_err();
    match &err {
        Error::MemoryLimit { device, requested, in_use, limit, .. } => {
            assert_eq!((device.as_str(), *requested, *in_use, *limit), ("/device:GPU:1 (GPU 0)", 2000, 8192, 10_000));
        }
        other => panic!("{other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "cannot allocate 2000 bytes on /device:GPU:1 (GPU 0): 8192 bytes are in use and the limit is 10000 bytes \
             (the memory_limit of the logical device, 9.8 KiB); free buffers, allocate less, or raise memory_limit"
        ),
        "{msg}"
    );
    assert!(msg.contains("the request takes 2048 bytes"), "{msg}");
    assert!(!msg.ends_with('.'));
    // Refusals change nothing.
    assert_eq!(counts(&backend), sim(1, 0, 8192));
    assert_eq!(t.memory_info(&device).current, 8192);
    // What fits still fits: 8192 + 1536 <= 10000.
    let b = pool.allocate(1536).unwrap();
    assert_eq!(t.memory_info(&device).current, 9728);
    drop((a, b));

    // A policy limit names the policy.
    let (pool, _, _) = self::pool(MemoryPolicy::Limit(64 * KIB), None, Some(MIB), MIB);
    let err = pool.allocate(64 * KIB + 1).unwrap_err().to_string();
    assert!(err.contains("cannot allocate 65537 bytes on /device:GPU:0 (GPU 0): 0 bytes are in use and the limit is 65536 bytes (memory policy limit:64KiB, 64.0 KiB)"), "{err}");
    assert!(err.contains("raise the memory policy"), "{err}");
}

#[test]
fn fraction_reserves_its_share() {
    let (pool, backend, _) = pool(MemoryPolicy::Fraction(0.25), None, Some(4 * MIB), 4 * MIB);
    assert_eq!(pool.config().limit, Some(MIB));
    let a = pool.allocate(MIB).unwrap();
    assert_eq!(counts(&backend), sim(1, 0, MIB));
    drop(a);
    match pool.allocate(MIB + 1).unwrap_err() {
        Error::MemoryLimit { requested, in_use, limit, .. } => {
            assert_eq!((requested, in_use, limit), (MIB + 1, 0, MIB))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn grab_all_reserves_most_of_the_free_memory() {
    let (pool, backend, _) = pool(MemoryPolicy::GrabAll, None, Some(MIB), MIB);
    backend.occupy(48 * KIB); // another process: 976 KiB free
    let _a = pool.allocate(1).unwrap();
    // 95% of 999424 bytes is 949452.8, rounded down to whole blocks.
    let reserved = 949_452 / GRANULE * GRANULE;
    assert_eq!(counts(&backend), sim(1, 0, reserved));
    assert_eq!(pool.stats().limit, Some(reserved));
    match pool.allocate(reserved).unwrap_err() {
        Error::MemoryLimit { in_use, limit, .. } => assert_eq!((in_use, limit), (GRANULE, reserved)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn peak_tracking() {
    let (pool, _, t) = pool(MemoryPolicy::Growth, None, None, MIB);
    let d = DeviceSpec::gpu(0);
    let a = pool.allocate(KIB).unwrap();
    let b = pool.allocate(2 * KIB).unwrap();
    let c = pool.allocate(4 * KIB).unwrap();
    drop(b);
    let info = t.memory_info(&d);
    assert_eq!((info.current, info.peak), (5 * KIB, 7 * KIB));
    assert_eq!(pool.stats().peak, 7 * KIB);
    t.reset_peak(&d);
    assert_eq!(t.memory_info(&d).peak, 5 * KIB);
    let b = pool.allocate(2 * KIB).unwrap(); // the cached block
    assert_eq!(t.memory_info(&d).peak, 7 * KIB);
    drop((a, b, c));
    assert_eq!(t.memory_info(&d), strata_core::device::MemoryInfo { current: 0, peak: 7 * KIB });
}

#[test]
fn cache_is_released_on_backend_pressure() {
    // A 4 KiB device with no limit of our own.
    let (pool, backend, _) = pool(MemoryPolicy::Growth, None, None, 4 * KIB);
    drop((pool.allocate(2 * KIB).unwrap(), pool.allocate(2 * KIB).unwrap()));
    assert_eq!(counts(&backend), sim(2, 0, 4 * KIB));
    // 3 KiB fits no cached block and the device is full: the cache goes, then it fits.
    let c = pool.allocate(3 * KIB).unwrap();
    assert_eq!(counts(&backend), sim(3, 2, 3 * KIB));
    assert_eq!(backend.stats().out_of_memory, 1);
    // Nothing left to release: a clear out-of-memory error.
    let err = pool.allocate(2 * KIB).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { requested: 2048, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("out of memory on /device:GPU:0 (GPU 0): cannot allocate 2048 bytes"), "{msg}");
    assert!(msg.contains("1024 bytes free on it") && msg.contains("3072 bytes of Strata's buffers"), "{msg}");
    assert_eq!(pool.stats().in_use, 3 * KIB);
    drop(c);
}

#[test]
fn cache_is_released_on_limit_pressure() {
    let (pool, backend, _) = pool(MemoryPolicy::Growth, Some(4 * KIB), None, MIB);
    drop((pool.allocate(2 * KIB).unwrap(), pool.allocate(KIB).unwrap()));
    assert_eq!(pool.stats().held, 3 * KIB);
    // 3 KiB is in the limit (nothing in use) but holding it besides the cache is not: the
    // largest cached block (2 KiB) goes, then 1 KiB cached + 3 KiB new = the limit.
    let c = pool.allocate(3 * KIB).unwrap();
    assert_eq!(counts(&backend), sim(3, 1, 4 * KIB));
    let s = pool.stats();
    assert_eq!((s.held, s.cached, s.in_use), (4 * KIB, KIB, 3 * KIB));
    // The cached 1 KiB block still serves a 1 KiB request.
    let d = pool.allocate(KIB).unwrap();
    assert_eq!(counts(&backend).0, 3);
    drop((c, d));
}

#[test]
fn reservation_fragmentation_is_reported() {
    let (pool, _, _) = pool(MemoryPolicy::Limit(4 * KIB), None, None, MIB);
    let blocks: Vec<_> = (0..4).map(|_| pool.allocate(KIB).unwrap()).collect();
    let mut blocks: Vec<Option<_>> = blocks.into_iter().map(Some).collect();
    blocks[0] = None;
    blocks[2] = None;
    let err = pool.allocate(2 * KIB).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{msg}");
    assert!(
        msg.contains("the 4096 bytes reserved for it have 2048 bytes free, but the largest free range is 1024 bytes"),
        "{msg}"
    );
    blocks[1] = None;
    let _fits = pool.allocate(3 * KIB).unwrap();
}

#[test]
fn reservation_larger_than_the_device_fails_clearly() {
    let (pool, backend, _) = pool(MemoryPolicy::Limit(2 * MIB), None, None, MIB);
    let msg = pool.allocate(1).unwrap_err().to_string();
    assert!(msg.contains("could not reserve 2097152 bytes up front: the device has 1048576 bytes free"), "{msg}");
    assert!(msg.contains("memory policy limit:2MiB"), "{msg}");
    assert_eq!(counts(&backend), sim(0, 0, 0));
}

#[test]
fn logical_gpus_get_their_own_pools_on_one_physical_gpu() {
    let registry = DeviceRegistry::new().with_cuda_visible_devices(None);
    registry.register_enumerator(Box::new(StaticEnumerator::fake_gpus(2, 4 * MIB))).unwrap();
    let gpus = registry.list_physical_devices(Some(DeviceType::Gpu)).unwrap();
    registry
        .set_logical_device_configuration(
            &gpus[0],
            vec![LogicalDeviceConfiguration::gpu(256 * KIB), LogicalDeviceConfiguration::gpu(MIB)],
        )
        .unwrap();
    let logical = registry.list_logical_devices(None).unwrap();
    let t = tracker();
    // One simulated device per physical GPU, shared by its logical GPUs.
    let physical: Vec<SimulatedBackend> = (0..2).map(|_| SimulatedBackend::new(4 * MIB)).collect();
    let pools =
        DevicePools::new(&logical, MemoryPolicy::Growth, t, |d| Ok(physical[d.physical.index as usize].clone()))
            .unwrap();
    assert_eq!(pools.pools().len(), 3, "CPUs get no pool");
    let limits: Vec<Option<u64>> = pools.pools().iter().map(|p| p.config().limit).collect();
    assert_eq!(limits, vec![Some(256 * KIB), Some(MIB), Some(4 * MIB)]);

    let g0 = pools.pool(&"/gpu:0".parse().unwrap()).unwrap();
    let g1 = pools.pool(&DeviceSpec::gpu(1)).unwrap();
    let a = g0.allocate(200 * KIB).unwrap();
    let err = g0.allocate(100 * KIB).unwrap_err();
    assert!(
        matches!(&err, Error::MemoryLimit { device, requested, in_use, limit, .. }
            if device == "/device:GPU:0 (GPU 0)" && *requested == 100 * KIB && *in_use == 200 * KIB && *limit == 256 * KIB),
        "{err:?}"
    );
    // GPU:1 is on the same physical GPU, with its own limit.
    let b = g1.allocate(900 * KIB).unwrap();
    assert_eq!(physical[0].stats().allocated, 1100 * KIB);
    assert_eq!(physical[1].stats().allocations, 0);
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)).current, 200 * KIB);
    assert_eq!(t.memory_info(&DeviceSpec::gpu(1)).current, 900 * KIB);
    let c = pools.pool(&DeviceSpec::gpu(2)).unwrap().allocate(3 * MIB).unwrap();
    assert_eq!(physical[1].stats().allocated, 3 * MIB);
    let err = pools.pool(&DeviceSpec::gpu(3)).unwrap_err().to_string();
    assert!(err.contains("/device:GPU:0, /device:GPU:1, /device:GPU:2"), "{err}");
    drop((a, b, c));
}

#[test]
fn many_threads_share_a_pool() {
    let (pool, backend, t) = pool(MemoryPolicy::Limit(MIB), None, None, MIB);
    std::thread::scope(|s| {
        for i in 0..4u64 {
            let pool = pool.clone();
            s.spawn(move || {
                for j in 0..200u64 {
                    let a = pool.allocate(100 + (i * 200 + j) % 3000).unwrap();
                    let b = pool.allocate(64).unwrap();
                    assert_ne!(a.address(), b.address());
                }
            });
        }
    });
    let s = pool.stats();
    assert_eq!((s.in_use, s.buffers, s.cached), (0, 0, MIB));
    assert_eq!(counts(&backend), sim(1, 0, MIB));
    assert_eq!(t.memory_info(&DeviceSpec::gpu(0)).current, 0);
    assert!(s.peak >= round_size(100).unwrap() + GRANULE);
}

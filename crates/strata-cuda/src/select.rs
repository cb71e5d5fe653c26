//! Which cross-device ops reduce the replicas of one machine: TensorFlow's
//! `select_cross_device_ops`, as a pure function.
//!
//! | replica devices                                   | NCCL loads | chosen                       |
//! |---------------------------------------------------|------------|------------------------------|
//! | all on the CPU                                    | any        | [`CrossDeviceImpl::Cpu`]     |
//! | CPU and GPU mixed                                 | any        | [`CrossDeviceImpl::Cpu`]     |
//! | GPUs, one of them a virtual GPU (a logical split) | any        | [`CrossDeviceImpl::Kernels`] |
//! | GPUs, each a whole physical GPU                   | no         | [`CrossDeviceImpl::Kernels`] |
//! | GPUs, each a whole physical GPU                   | yes        | [`CrossDeviceImpl::Nccl`]    |
//!
//! A GPU replica is *virtual* when its physical GPU holds more than one logical GPU (in the
//! machine's logical devices or among the replicas): NCCL needs one rank per physical GPU, so
//! virtual GPUs never use NCCL (TensorFlow: "NCCL is not supported when using virtual GPUs").
//! TensorFlow applies this machine-wide (any split GPU disables NCCL); Strata looks only at
//! the physical GPUs the replicas use, since NCCL between whole GPUs is unaffected by a split
//! elsewhere. "Kernels" are Strata's CUDA kernels: reduction to one device and the hierarchical
//! copy over peer-accessible buffers; "Cpu" reduces on the host (TensorFlow's
//! `ReductionToOneDevice` onto the CPU).
//!
//! An explicit [`CrossDeviceChoice`] wins, but one that cannot work is an error rather than a
//! silent fallback: NCCL on virtual GPUs, on CPU replicas or without NCCL; Strata's kernels on
//! CPU replicas.
//!
//! ```
//! use strata_cuda::select::{select_cross_device_ops, CrossDeviceChoice, CrossDeviceImpl};
//! use strata_core::device::logical_cpus;
//!
//! let cpus = logical_cpus(2).unwrap();
//! let s = select_cross_device_ops(&cpus, &[], false, CrossDeviceChoice::Auto).unwrap();
//! assert_eq!(s.implementation, CrossDeviceImpl::Cpu);
//! assert!(select_cross_device_ops(&cpus, &[], true, CrossDeviceChoice::Nccl).is_err());
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use strata_core::device::{DeviceType, LogicalDevice};

use crate::{Error, Result};

/// What the user asked for (`--cross-device-ops`, a strategy option): `Auto` applies the rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CrossDeviceChoice {
    /// TensorFlow's rule (the table in the module docs).
    #[default]
    Auto,
    /// NCCL all-reduce, one communicator per GPU.
    Nccl,
    /// Strata's CUDA kernels (reduction to one device, hierarchical copy).
    Kernels,
    /// Reduction on the host CPU.
    Cpu,
}

impl CrossDeviceChoice {
    /// Every choice, in the order of its names.
    pub const ALL: [CrossDeviceChoice; 4] =
        [CrossDeviceChoice::Auto, CrossDeviceChoice::Nccl, CrossDeviceChoice::Kernels, CrossDeviceChoice::Cpu];

    /// The lower-case name: `auto`, `nccl`, `kernels`, `cpu`.
    pub fn as_str(self) -> &'static str {
        match self {
            CrossDeviceChoice::Auto => "auto",
            CrossDeviceChoice::Nccl => "nccl",
            CrossDeviceChoice::Kernels => "kernels",
            CrossDeviceChoice::Cpu => "cpu",
        }
    }
}

impl fmt::Display for CrossDeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CrossDeviceChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        Self::ALL.into_iter().find(|c| c.as_str() == lower).ok_or_else(|| Error::CrossDeviceChoice {
            choice: "the requested ops",
            reason: format!("{s:?} is not one of auto, nccl, kernels, cpu"),
        })
    }
}

/// The cross-device ops chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrossDeviceImpl {
    /// NCCL all-reduce (`NcclComms` of [`crate::nccl`], feature `nccl`).
    Nccl,
    /// Strata's CUDA kernels.
    Kernels,
    /// The CPU cross-device ops of strata-core.
    Cpu,
}

impl CrossDeviceImpl {
    /// The lower-case name: `nccl`, `kernels`, `cpu`.
    pub fn as_str(self) -> &'static str {
        match self {
            CrossDeviceImpl::Nccl => "nccl",
            CrossDeviceImpl::Kernels => "kernels",
            CrossDeviceImpl::Cpu => "cpu",
        }
    }
}

impl fmt::Display for CrossDeviceImpl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The choice and why, in one line (for logs and `strata devices`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// What reduces across the replicas.
    pub implementation: CrossDeviceImpl,
    /// Why, in one line.
    pub reason: String,
}

/// What the rule sees of the replicas.
struct Census {
    cpus: Vec<String>,
    gpus: usize,
    /// Physical GPUs (by driver ordinal) holding more than one logical GPU, with that count.
    virtual_gpus: BTreeMap<u32, usize>,
}

fn census(replicas: &[LogicalDevice], machine_gpus: &[LogicalDevice]) -> Census {
    let mut cpus = Vec::new();
    let mut gpus = 0usize;
    // Logical GPUs per physical GPU: the machine's, and the replicas' (a replica listed twice,
    // or a logical device absent from the machine list, still counts).
    let mut per_physical: BTreeMap<u32, std::collections::BTreeSet<String>> = BTreeMap::new();
    for d in machine_gpus.iter().filter(|d| d.device_type() == DeviceType::Gpu) {
        per_physical.entry(d.physical.index).or_default().insert(d.spec.device_part().to_string());
    }
    let mut replica_physical: BTreeMap<u32, usize> = BTreeMap::new();
    for d in replicas {
        match d.device_type() {
            DeviceType::Cpu => cpus.push(d.spec.to_string()),
            DeviceType::Gpu => {
                gpus += 1;
                *replica_physical.entry(d.physical.index).or_default() += 1;
                per_physical.entry(d.physical.index).or_default().insert(d.spec.device_part().to_string());
            }
        }
    }
    let virtual_gpus = replica_physical
        .iter()
        .filter_map(|(&p, &replicas_on_it)| {
            let logical = per_physical.get(&p).map_or(0, |s| s.len()).max(replicas_on_it);
            (logical > 1).then_some((p, logical))
        })
        .collect();
    Census { cpus, gpus, virtual_gpus }
}

fn describe_virtual(v: &BTreeMap<u32, usize>) -> String {
    v.iter().map(|(p, n)| format!("physical GPU {p} holds {n} logical GPUs")).collect::<Vec<_>>().join(", ")
}

const NO_NCCL: &str = "NCCL is not available (strata was built without the `nccl` feature, or the CUDA driver or libnccl.so did not load)";

/// Chooses the cross-device ops for `replicas` (the logical devices the replicas run on, one
/// per replica). `machine_gpus` are the machine's logical GPUs (to see which physical GPUs are
/// split; may be empty), `nccl_available` whether NCCL loads
/// ([`crate::nccl::nccl_available`]), and `choice` the user's request.
pub fn select_cross_device_ops(
    replicas: &[LogicalDevice],
    machine_gpus: &[LogicalDevice],
    nccl_available: bool,
    choice: CrossDeviceChoice,
) -> Result<Selection> {
    if replicas.is_empty() {
        return Err(Error::CrossDeviceChoice {
            choice: "any cross-device ops",
            reason: "there are no replica devices".into(),
        });
    }
    let c = census(replicas, machine_gpus);
    let n = replicas.len();
    let all_cpu = c.gpus == 0;
    let mixed = c.gpus > 0 && !c.cpus.is_empty();
    let ok = |implementation, reason: String| Ok(Selection { implementation, reason });
    let refuse = |choice, reason: String| Err(Error::CrossDeviceChoice { choice, reason });
    match choice {
        CrossDeviceChoice::Auto => {
            if all_cpu {
                ok(CrossDeviceImpl::Cpu, format!("all {n} replica(s) are on the CPU: CPU cross-device ops"))
            } else if mixed {
                ok(
                    CrossDeviceImpl::Cpu,
                    format!(
                        "replicas on both CPU ({}) and GPU: reduction on the host (not NCCL, not GPU kernels)",
                        c.cpus.join(", ")
                    ),
                )
            } else if !c.virtual_gpus.is_empty() {
                ok(
                    CrossDeviceImpl::Kernels,
                    format!(
                        "virtual GPUs ({}) never use NCCL: Strata's kernels (reduction to one device)",
                        describe_virtual(&c.virtual_gpus)
                    ),
                )
            } else if !nccl_available {
                ok(CrossDeviceImpl::Kernels, format!("{NO_NCCL}: Strata's kernels"))
            } else {
                ok(
                    CrossDeviceImpl::Nccl,
                    format!("all {n} replica(s) are distinct physical GPUs and NCCL loads: NCCL all-reduce"),
                )
            }
        }
        CrossDeviceChoice::Nccl => {
            if !c.cpus.is_empty() {
                refuse(
                    "nccl",
                    format!("NCCL reduces GPU buffers but replica device(s) {} are on the CPU", c.cpus.join(", ")),
                )
            } else if !c.virtual_gpus.is_empty() {
                refuse(
                    "nccl",
                    format!(
                        "NCCL needs one rank per physical GPU but the replicas use virtual GPUs ({}); use kernels or auto",
                        describe_virtual(&c.virtual_gpus)
                    ),
                )
            } else if !nccl_available {
                refuse("nccl", format!("{NO_NCCL}; install NCCL or choose kernels or auto"))
            } else {
                ok(CrossDeviceImpl::Nccl, format!("NCCL all-reduce over {n} GPU(s), as requested"))
            }
        }
        CrossDeviceChoice::Kernels => {
            if !c.cpus.is_empty() {
                refuse(
                    "kernels",
                    format!(
                        "Strata's kernels run on GPUs but replica device(s) {} are on the CPU; use cpu or auto",
                        c.cpus.join(", ")
                    ),
                )
            } else {
                ok(CrossDeviceImpl::Kernels, format!("Strata's kernels over {n} GPU(s), as requested"))
            }
        }
        CrossDeviceChoice::Cpu => ok(
            CrossDeviceImpl::Cpu,
            if all_cpu {
                format!("CPU cross-device ops over {n} replica(s), as requested")
            } else {
                format!("reduction on the host over {n} replica(s) (GPU buffers copied through the CPU), as requested")
            },
        ),
    }
}

#[cfg(test)]
mod tests {
    use strata_core::device::{DeviceSpec, LogicalKind, PhysicalDevice};

    use super::*;

    fn physical_gpu(index: u32) -> PhysicalDevice {
        PhysicalDevice {
            index,
            device_type: DeviceType::Gpu,
            name: "test GPU".into(),
            uuid: Some(format!("GPU-{index:08x}-0000-0000-0000-000000000000")),
            memory_bytes: Some(80 << 30),
            compute_capability: Some((9, 0)),
            cores: Some(132),
        }
    }

    /// Logical GPU `logical` on physical GPU `physical`.
    fn gpu(logical: u32, physical: u32) -> LogicalDevice {
        LogicalDevice {
            spec: DeviceSpec::gpu(logical),
            physical: physical_gpu(physical),
            kind: LogicalKind::Gpu { memory_limit: None },
        }
    }

    fn cpus(n: usize) -> Vec<LogicalDevice> {
        strata_core::device::logical_cpus(n).unwrap()
    }

    fn auto(replicas: &[LogicalDevice], machine: &[LogicalDevice], nccl: bool) -> Selection {
        select_cross_device_ops(replicas, machine, nccl, CrossDeviceChoice::Auto).unwrap()
    }

    #[test]
    fn physical_gpus_with_nccl_use_nccl() {
        let g = [gpu(0, 0), gpu(1, 1), gpu(2, 2), gpu(3, 3)];
        let s = auto(&g, &g, true);
        assert_eq!(s.implementation, CrossDeviceImpl::Nccl);
        assert!(s.reason.contains("distinct physical GPUs"), "{}", s.reason);
        // Visible order differs from driver order (CUDA_VISIBLE_DEVICES=2,3): still physical.
        let g = [gpu(0, 2), gpu(1, 3)];
        assert_eq!(auto(&g, &g, true).implementation, CrossDeviceImpl::Nccl);
    }

    #[test]
    fn physical_gpus_without_nccl_use_kernels() {
        let g = [gpu(0, 0), gpu(1, 1)];
        let s = auto(&g, &g, false);
        assert_eq!(s.implementation, CrossDeviceImpl::Kernels);
        assert!(s.reason.contains("NCCL is not available"), "{}", s.reason);
    }

    #[test]
    fn virtual_gpus_never_use_nccl() {
        // One physical GPU split into two logical GPUs, both replicas.
        let g = [gpu(0, 0), gpu(1, 0)];
        let s = auto(&g, &g, true);
        assert_eq!(s.implementation, CrossDeviceImpl::Kernels);
        assert!(s.reason.contains("physical GPU 0 holds 2 logical GPUs"), "{}", s.reason);
        // A replica on a split GPU whose sibling is not a replica: still virtual.
        let machine = [gpu(0, 0), gpu(1, 0), gpu(2, 1)];
        let s = auto(&[gpu(0, 0), gpu(2, 1)], &machine, true);
        assert_eq!(s.implementation, CrossDeviceImpl::Kernels, "{}", s.reason);
        // The same logical GPU listed twice as two replicas: two ranks on one GPU.
        let s = auto(&[gpu(0, 0), gpu(0, 0)], &[], true);
        assert_eq!(s.implementation, CrossDeviceImpl::Kernels, "{}", s.reason);
        // A split elsewhere on the machine does not affect replicas on whole GPUs.
        let machine = [gpu(0, 0), gpu(1, 1), gpu(2, 2), gpu(3, 2)];
        let s = auto(&[gpu(0, 0), gpu(1, 1)], &machine, true);
        assert_eq!(s.implementation, CrossDeviceImpl::Nccl, "{}", s.reason);
    }

    #[test]
    fn a_memory_limit_alone_is_not_a_virtual_gpu() {
        let mut g = [gpu(0, 0), gpu(1, 1)];
        for d in &mut g {
            d.kind = LogicalKind::Gpu { memory_limit: Some(1 << 30) };
        }
        assert_eq!(auto(&g, &g, true).implementation, CrossDeviceImpl::Nccl);
    }

    #[test]
    fn cpu_replicas_use_the_cpu_ops() {
        for nccl in [false, true] {
            let s = auto(&cpus(4), &[], nccl);
            assert_eq!(s.implementation, CrossDeviceImpl::Cpu);
            assert!(s.reason.contains("all 4 replica(s) are on the CPU"), "{}", s.reason);
        }
    }

    #[test]
    fn mixed_cpu_and_gpu_replicas_reduce_on_the_host() {
        let mut r = cpus(1);
        r.push(gpu(0, 0));
        let s = auto(&r, &[gpu(0, 0)], true);
        assert_eq!(s.implementation, CrossDeviceImpl::Cpu);
        assert!(s.reason.contains("both CPU"), "{}", s.reason);
    }

    #[test]
    fn forced_nccl_is_honoured_or_refused_clearly() {
        let g = [gpu(0, 0), gpu(1, 1)];
        let s = select_cross_device_ops(&g, &g, true, CrossDeviceChoice::Nccl).unwrap();
        assert_eq!(s.implementation, CrossDeviceImpl::Nccl);

        let e = select_cross_device_ops(&g, &g, false, CrossDeviceChoice::Nccl).unwrap_err().to_string();
        assert!(e.starts_with("cannot use nccl for cross-device ops: NCCL is not available"), "{e}");

        let v = [gpu(0, 0), gpu(1, 0)];
        let e = select_cross_device_ops(&v, &v, true, CrossDeviceChoice::Nccl).unwrap_err().to_string();
        assert!(e.contains("virtual GPUs (physical GPU 0 holds 2 logical GPUs)"), "{e}");

        let e = select_cross_device_ops(&cpus(2), &[], true, CrossDeviceChoice::Nccl).unwrap_err().to_string();
        assert!(e.contains("are on the CPU"), "{e}");
    }

    #[test]
    fn forced_kernels_need_gpus() {
        let v = [gpu(0, 0), gpu(1, 0)];
        let s = select_cross_device_ops(&v, &v, true, CrossDeviceChoice::Kernels).unwrap();
        assert_eq!(s.implementation, CrossDeviceImpl::Kernels);
        let g = [gpu(0, 0), gpu(1, 1)];
        assert_eq!(
            select_cross_device_ops(&g, &g, true, CrossDeviceChoice::Kernels).unwrap().implementation,
            CrossDeviceImpl::Kernels
        );
        let e = select_cross_device_ops(&cpus(2), &[], false, CrossDeviceChoice::Kernels).unwrap_err().to_string();
        assert!(e.starts_with("cannot use kernels for cross-device ops: Strata's kernels run on GPUs"), "{e}");
    }

    #[test]
    fn forced_cpu_always_works() {
        let g = [gpu(0, 0), gpu(1, 1)];
        for r in [&g[..], &cpus(2)[..]] {
            let s = select_cross_device_ops(r, &g, true, CrossDeviceChoice::Cpu).unwrap();
            assert_eq!(s.implementation, CrossDeviceImpl::Cpu);
            assert!(s.reason.ends_with("as requested"), "{}", s.reason);
        }
    }

    #[test]
    fn no_replicas_is_an_error() {
        assert!(select_cross_device_ops(&[], &[], true, CrossDeviceChoice::Auto).is_err());
    }

    #[test]
    fn reasons_are_one_line() {
        let cases: Vec<Vec<LogicalDevice>> =
            vec![cpus(2), vec![gpu(0, 0), gpu(1, 1)], vec![gpu(0, 0), gpu(1, 0)], vec![cpus(1)[0].clone(), gpu(0, 0)]];
        for r in &cases {
            for nccl in [false, true] {
                for choice in CrossDeviceChoice::ALL {
                    if let Ok(s) = select_cross_device_ops(r, &[], nccl, choice) {
                        assert!(!s.reason.contains('\n') && !s.reason.is_empty(), "{}", s.reason);
                    }
                }
            }
        }
    }

    #[test]
    fn choices_parse_and_print() {
        for c in CrossDeviceChoice::ALL {
            assert_eq!(c.to_string().parse::<CrossDeviceChoice>().unwrap(), c);
        }
        assert_eq!(" NCCL ".parse::<CrossDeviceChoice>().unwrap(), CrossDeviceChoice::Nccl);
        let e = "gloo".parse::<CrossDeviceChoice>().unwrap_err().to_string();
        assert!(e.contains("\"gloo\" is not one of auto, nccl, kernels, cpu"), "{e}");
        assert_eq!(CrossDeviceChoice::default(), CrossDeviceChoice::Auto);
    }
}

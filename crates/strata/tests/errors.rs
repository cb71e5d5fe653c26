//! Every error type the facade re-exports (directly or through its re-exported modules)
//! converts into `strata::Error` with `?`: each function below returns `strata::Result` and uses
//! `?` on a value of one such type, so this file does not compile without the conversion. Each
//! test then checks the converted error says what the original said and carries the exit code
//! of its cause: 2 for input the user can fix, 1 for failures at run time.

use std::collections::HashMap;
use std::fmt::Display;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use strata::cluster::{ClusterResolver, ClusterSpec, SlurmClusterResolver, TFConfigClusterResolver, TaskType};
use strata::device::{DeviceType, PhysicalDevice};
use strata::prelude::*;
use strata::ps::{PsClient, PsClientConfig, PsServerConfig, PsServerHandle, ServerOptimizer, VariableInfo};
use strata::{Error, StrategyKind};

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// Checks that `converted` failed with `original`'s message and the exit code `code`, and
/// returns its error.
#[track_caller]
fn check<T: std::fmt::Debug>(original: impl Display, converted: strata::Result<T>, code: i32) -> Error {
    let e = converted.expect_err("the conversion should keep the error");
    assert_eq!(e.to_string(), original.to_string());
    assert_eq!(e.exit_code(), code, "exit code of {e:?}");
    e
}

// strata_transport::Error: ClusterToken::resolve's, the ps clients' and servers'.

/// What a multi-worker program does first: `MultiWorkerOptions::new(ClusterToken::resolve(..)?)?`.
fn options_from_token_file(file: &Path) -> strata::Result<MultiWorkerOptions> {
    Ok(MultiWorkerOptions::new(ClusterToken::resolve(Some(file))?)?)
}

#[test]
fn a_cluster_token_that_is_missing_or_malformed_is_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("token");
    std::fs::write(&good, format!("{TOKEN}\n")).unwrap();
    options_from_token_file(&good).unwrap();

    let short = tmp.path().join("short");
    std::fs::write(&short, "short\n").unwrap();
    let e = check(ClusterToken::resolve(Some(&short)).unwrap_err(), options_from_token_file(&short), 2);
    assert!(matches!(e, Error::Transport(strata_transport::Error::Config(_))), "{e:?}");
    assert!(e.to_string().contains("at least"), "{e}");

    let missing = tmp.path().join("missing");
    let e = check(ClusterToken::resolve(Some(&missing)).unwrap_err(), options_from_token_file(&missing), 2);
    assert!(matches!(e, Error::Transport(strata_transport::Error::Io { .. })), "{e:?}");
}

fn start_ps(address: std::net::SocketAddr) -> strata::Result<PsServerHandle> {
    Ok(PsServerHandle::start(address, PsServerConfig::new("ps:0", ClusterToken::new(TOKEN)?))?)
}

fn pull(client: &PsClient, names: &[&str]) -> strata::Result<()> {
    client.pull(names, 0)?;
    Ok(())
}

#[test]
fn transport_errors_convert_with_the_exit_code_of_their_cause() {
    let server = start_ps("127.0.0.1:0".parse().unwrap()).unwrap();
    let address = server.address();

    // Its port is taken: the address to listen on is the user's to change.
    let original = PsServerHandle::start(address, PsServerConfig::new("ps:0", ClusterToken::new(TOKEN).unwrap()));
    let e = check(original.err().unwrap(), start_ps(address), 2);
    assert!(matches!(e, Error::Transport(strata_transport::Error::Bind { .. })), "{e:?}");

    // A client whose token is not the cluster's.
    let config = || PsClientConfig { retry_for: std::time::Duration::ZERO, ..Default::default() };
    let other = ClusterToken::new("fedcba9876543210fedcba9876543210").unwrap();
    let stranger = PsClient::connect(&address.to_string(), "ps:0", other, config()).unwrap();
    let e = check(stranger.pull(&["w"], 0).unwrap_err(), pull(&stranger, &["w"]), 2);
    assert!(matches!(e, Error::Transport(strata_transport::Error::Unauthenticated(_))), "{e:?}");

    // The task refuses a pull of a variable it does not hold: a failure at run time.
    let client = PsClient::connect(&address.to_string(), "ps:0", ClusterToken::new(TOKEN).unwrap(), config()).unwrap();
    let e = check(client.pull(&["w"], 0).unwrap_err(), pull(&client, &["w"]), 1);
    assert!(matches!(e, Error::Transport(_)), "{e:?}");
    server.shutdown();
}

// strata_transport::ps::PsError (strata-ps' error): what strata::ps's types validate with.

fn validate_optimizer(optimizer: &ServerOptimizer) -> strata::Result<()> {
    optimizer.validate()?;
    Ok(())
}

fn validate_variable(variable: &VariableInfo) -> strata::Result<()> {
    variable.validate()?;
    Ok(())
}

#[test]
fn a_parameter_server_setting_that_does_not_validate_is_bad_input() {
    validate_optimizer(&ServerOptimizer::Sgd { lr: 0.1 }).unwrap();
    let negative = ServerOptimizer::Sgd { lr: -0.1 };
    let e = check(negative.validate().unwrap_err(), validate_optimizer(&negative), 2);
    assert!(matches!(e, Error::Ps(strata::ps::PsError::LearningRate { .. })), "{e:?}");

    let unnamed = VariableInfo::whole("", vec![2, 2]);
    let e = check(unnamed.validate().unwrap_err(), validate_variable(&unnamed), 2);
    assert!(matches!(e, Error::Ps(_)), "{e:?}");
}

// strata_core::Error (strata::CoreError): the strategies', the cluster resolvers', the
// checkpoints' and the data's.

fn resolve(resolver: &dyn ClusterResolver) -> strata::Result<()> {
    resolver.resolve()?;
    Ok(())
}

#[test]
fn a_malformed_cluster_configuration_is_bad_input() {
    let tf_config = TFConfigClusterResolver::from_json(r#"{"cluster": {"worker": ["w0:2222"]}, "task": "#);
    let e = check(tf_config.resolve().unwrap_err(), resolve(&tf_config), 2);
    assert!(matches!(e, Error::Core(strata::CoreError::InvalidCluster(_))), "{e:?}");
    assert!(e.to_string().contains("TF_CONFIG"), "{e}");

    let vars: HashMap<String, String> = [("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let slurm = SlurmClusterResolver::from_vars(&vars);
    check(slurm.resolve().unwrap_err(), resolve(&slurm), 2);

    let spec = || ClusterSpec::new([(TaskType::Worker, vec!["no port here"])]);
    let converted = || -> strata::Result<ClusterSpec> { Ok(spec()?) };
    check(spec().unwrap_err(), converted(), 2);
}

fn mirrored(replicas: usize) -> strata::Result<MirroredStrategy> {
    Ok(MirroredStrategy::logical_cpus(replicas)?)
}

fn read_checkpoint(dir: &Path) -> strata::Result<()> {
    strata::checkpoint::read_checkpoint(dir)?;
    Ok(())
}

#[test]
fn core_errors_keep_their_exit_codes() {
    mirrored(2).unwrap();
    let e = check(MirroredStrategy::logical_cpus(0).unwrap_err(), mirrored(0), 2);
    assert!(matches!(e, Error::Core(strata::CoreError::InvalidDeviceList(_))), "{e:?}");

    // A checkpoint that is not there: a failure of the run (the trainer checks its directory
    // before training and says so with exit code 2).
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("ckpt-0");
    let e = check(strata::checkpoint::read_checkpoint(&missing).unwrap_err(), read_checkpoint(&missing), 1);
    assert!(matches!(e, Error::Core(_)), "{e:?}");
}

// candle_core::Error. With RUST_BACKTRACE set, candle's message ends with the backtrace of where
// the error was made, so the error compared is the one converted, not a second one.

fn candle(result: candle_core::Result<Tensor>) -> strata::Result<Tensor> {
    Ok(result?)
}

#[test]
fn candle_errors_are_failures_at_run_time() {
    let a = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    candle(a.matmul(&a.t().unwrap())).unwrap();
    let product = a.matmul(&a);
    let original = product.as_ref().unwrap_err().to_string();
    let e = check(original, candle(product), 1);
    assert!(matches!(e, Error::Candle(_)), "{e:?}");
    assert!(e.to_string().starts_with("shape mismatch in matmul"), "{e}");
}

// strata_cuda::Error: the GPU path's (strata::gpu takes its CrossDeviceChoice).

fn cross_device_choice(name: &str) -> strata::Result<strata_cuda::select::CrossDeviceChoice> {
    Ok(name.parse::<strata_cuda::select::CrossDeviceChoice>()?)
}

fn gpus_as_driver_shows(all: &[PhysicalDevice], visible: &str) -> strata::Result<()> {
    strata_cuda::device::GpuTopology::as_driver_shows(all, Some(visible))?;
    Ok(())
}

fn nccl_id(bytes: &[u8]) -> strata::Result<()> {
    strata_cuda::nccl::NcclId::from_bytes(bytes)?;
    Ok(())
}

#[test]
fn gpu_path_errors_convert_with_the_exit_code_of_their_cause() {
    let e =
        check("gloo".parse::<strata_cuda::select::CrossDeviceChoice>().unwrap_err(), cross_device_choice("gloo"), 2);
    assert!(matches!(e, Error::Cuda(strata_cuda::Error::CrossDeviceChoice { .. })), "{e:?}");

    // strata-core's error inside the GPU path's keeps its exit code: a GPU listed twice.
    let gpu = |index: u32| PhysicalDevice {
        index,
        device_type: DeviceType::Gpu,
        name: format!("Fake GPU {index}"),
        uuid: None,
        memory_bytes: Some(1 << 30),
        compute_capability: Some((9, 0)),
        cores: None,
    };
    let all = [gpu(0), gpu(1)];
    gpus_as_driver_shows(&all, "1,0").unwrap();
    let original = strata_cuda::device::GpuTopology::as_driver_shows(&all, Some("0,0")).unwrap_err();
    let e = check(original, gpus_as_driver_shows(&all, "0,0"), 2);
    assert!(matches!(e, Error::Cuda(strata_cuda::Error::Core(strata::CoreError::InvalidDeviceList(_)))), "{e:?}");

    // Bytes received from a peer that are no NCCL id.
    let e = check(strata_cuda::nccl::NcclId::from_bytes(&[0; 12]).unwrap_err(), nccl_id(&[0; 12]), 1);
    assert!(matches!(e, Error::Cuda(strata_cuda::Error::InvalidNcclId(_))), "{e:?}");
}

// strata::kind::UnknownName: StrategyKind's and OptimizerKind's parse error.

fn strategy_kind(name: &str) -> strata::Result<StrategyKind> {
    Ok(name.parse::<StrategyKind>()?)
}

#[test]
fn an_unknown_strategy_name_is_bad_input() {
    assert_eq!(strategy_kind("mirrored").unwrap(), StrategyKind::Mirrored);
    let e = check("dp".parse::<StrategyKind>().unwrap_err(), strategy_kind("dp"), 2);
    assert!(matches!(e, Error::UnknownName(_)), "{e:?}");
    assert!(e.to_string().contains("mirrored"), "{e}");
}

//! The cluster's credentials: how every server of a job tells its own tasks from anyone else.
//!
//! Every RPC carries `authorization: Bearer <token>`; servers compare it in constant time
//! (`subtle`) and answer `UNAUTHENTICATED`, changing nothing, when it is missing or wrong. The
//! token comes from `STRATA_CLUSTER_TOKEN` or a file; `strata launch`
//! makes a fresh one for each local job.
//!
//! On a network that others can read, add mutual TLS ([`MutualTls`], rustls): with
//! `STRATA_TLS_DIR` naming a directory of `ca.pem`, `cert.pem` and `key.pem`, every gRPC
//! server (parameter server, worker executor, coordination service) serves TLS only and
//! admits only clients that present a certificate signed by the cluster's CA, and every client
//! connects over TLS with its own certificate and checks the server's against the same CA. The
//! token is still checked inside the encrypted connection. (The data plane of
//! MultiWorkerMirrored's ring is raw TCP, authenticated by the token, not encrypted.)

use std::path::Path;
use std::sync::Arc;

use subtle::ConstantTimeEq;
use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

use crate::{Error, Result};

/// The environment variable that holds the cluster token.
pub const TOKEN_ENV: &str = "STRATA_CLUSTER_TOKEN";

/// The environment variable that names the directory of the cluster's TLS files.
pub const TLS_DIR_ENV: &str = "STRATA_TLS_DIR";

/// A task's mutual-TLS identity in a cluster: the cluster's CA certificate, and this task's
/// certificate (signed by that CA; its subject alternative names cover the host names or IP
/// addresses other tasks dial) and private key, all PEM. The same identity serves as server and
/// as client.
#[derive(Clone)]
pub struct MutualTls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for MutualTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MutualTls(<redacted>)")
    }
}

impl MutualTls {
    /// An identity from PEM text; each must hold a PEM block (`-----BEGIN `).
    pub fn from_pem(ca: impl Into<Vec<u8>>, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Result<Self> {
        let (ca, cert, key) = (ca.into(), cert.into(), key.into());
        for (what, pem) in [("the CA certificate", &ca), ("the certificate", &cert), ("the private key", &key)] {
            if !pem.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(Error::Config(format!("{what} is not PEM (no -----BEGIN line)")));
            }
        }
        Ok(Self { ca, cert, key })
    }

    /// The identity in `dir`: `ca.pem`, `cert.pem` and `key.pem`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|e| {
                Error::io(format!("reading {} ({TLS_DIR_ENV} needs ca.pem, cert.pem and key.pem)", path.display()), e)
            })
        };
        Self::from_pem(read("ca.pem")?, read("cert.pem")?, read("key.pem")?)
            .map_err(|e| Error::Config(format!("{}: {e}", dir.display())))
    }

    /// The identity in the directory `STRATA_TLS_DIR` names, if it is set.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var_os(TLS_DIR_ENV) {
            Some(d) if !d.is_empty() => Self::from_dir(Path::new(&d)).map(Some),
            _ => Ok(None),
        }
    }

    fn identity(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(&self.cert, &self.key)
    }

    fn ca(&self) -> tonic::transport::Certificate {
        tonic::transport::Certificate::from_pem(&self.ca)
    }
}

/// A gRPC server builder for `token`'s cluster: TLS that requires a client certificate when
/// the token carries [`MutualTls`].
pub(crate) fn server_builder(token: &ClusterToken) -> Result<tonic::transport::Server> {
    let builder = tonic::transport::Server::builder();
    match token.tls() {
        None => Ok(builder),
        Some(tls) => builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(tls.identity()).client_ca_root(tls.ca()))
            .map_err(|e| Error::Config(format!("the cluster's TLS identity cannot serve: {e}"))),
    }
}

/// A gRPC endpoint of task `task` at `address` (`host:port`) for `token`'s cluster: over TLS
/// with the task's certificate when the token carries [`MutualTls`].
pub(crate) fn endpoint(address: &str, task: &str, token: &ClusterToken) -> Result<tonic::transport::Endpoint> {
    let usable =
        |e: &dyn std::fmt::Display| Error::Config(format!("the address {address:?} of {task} is not usable: {e}"));
    match token.tls() {
        None => tonic::transport::Endpoint::from_shared(format!("http://{address}")).map_err(|e| usable(&e)),
        Some(tls) => tonic::transport::Endpoint::from_shared(format!("https://{address}"))
            .map_err(|e| usable(&e))?
            .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(tls.ca()).identity(tls.identity()))
            .map_err(|e| usable(&e)),
    }
}

/// The shortest token accepted (a guessable token makes the cluster public).
pub const MIN_TOKEN_LEN: usize = 16;

/// A cluster's shared secret, and its mutual-TLS identity when it has one. Its `Debug` form
/// never shows the secret.
#[derive(Clone)]
pub struct ClusterToken {
    secret: Arc<str>,
    tls: Option<Arc<MutualTls>>,
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.tls {
            None => f.write_str("ClusterToken(<redacted>)"),
            Some(_) => f.write_str("ClusterToken(<redacted>, mutual TLS)"),
        }
    }
}

impl ClusterToken {
    /// A token from its text: at least [`MIN_TOKEN_LEN`] visible ASCII characters.
    pub fn new(text: &str) -> Result<Self> {
        let t = text.trim();
        if t.len() < MIN_TOKEN_LEN || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::Config(format!(
                "the cluster token must be at least {MIN_TOKEN_LEN} visible ASCII characters (got {} characters); generate one with `openssl rand -hex 32`",
                t.len()
            )));
        }
        Ok(Self { secret: t.into(), tls: None })
    }

    /// The same token, with every server and client of the cluster on mutual TLS.
    pub fn with_tls(self, tls: MutualTls) -> Self {
        Self { tls: Some(Arc::new(tls)), ..self }
    }

    /// The cluster's mutual-TLS identity, if it has one.
    pub fn tls(&self) -> Option<&MutualTls> {
        self.tls.as_deref()
    }

    /// The token in `STRATA_CLUSTER_TOKEN`, if it is set.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(TOKEN_ENV) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Self::new(&v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::Config(format!("{TOKEN_ENV} is not valid UTF-8; set it to a hex string")))
            }
        }
    }

    /// The token in a file (its first line).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the cluster token file {}", path.display()), e))?;
        Self::new(text.lines().next().unwrap_or("")).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// The token from `file` if given, else from `STRATA_CLUSTER_TOKEN`; an error that says
    /// how to provide one if neither is there. With mutual TLS when `STRATA_TLS_DIR` is set.
    pub fn resolve(file: Option<&Path>) -> Result<Self> {
        let token = match file {
            Some(f) => Self::from_file(f)?,
            None => Self::from_env()?.ok_or_else(|| {
                Error::Config(format!(
                    "no cluster token: set {TOKEN_ENV} to the same secret in every task (strata launch does this for you), or give a file that holds it"
                ))
            })?,
        };
        Ok(match MutualTls::from_env()? {
            Some(tls) => token.with_tls(tls),
            None => token,
        })
    }

    /// The secret itself, for handshakes that carry it (the data plane's).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// Whether `presented` is this token (constant time in the token's length).
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.secret.as_bytes().ct_eq(presented).into()
    }

    fn header(&self) -> Option<MetadataValue<tonic::metadata::Ascii>> {
        format!("Bearer {}", self.secret).parse().ok()
    }
}

/// The metadata key in which a client names its task (`worker:1`), so that a server can say
/// which task it refused.
pub const TASK_METADATA: &str = "x-strata-task";

/// The longest task name a refused call may claim (longer claims are recorded as unnamed).
const MAX_CLAIMED_TASK: usize = 64;

/// Why the token check refused a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The call carried another cluster's token.
    WrongToken,
    /// The call carried no token at all.
    MissingToken,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::WrongToken => "wrong cluster token",
            Refusal::MissingToken => "no cluster token",
        })
    }
}

/// Told of every call the token check refuses: the task the call claimed to come from (its
/// `x-strata-task` metadata; empty when absent or longer than 64 bytes), the peer's address,
/// and why. It runs on the server's threads for every refused call, so it must be cheap and
/// keep bounded state (an unauthenticated caller controls how often it runs).
pub type RefusalRecorder = Arc<dyn Fn(&str, Option<std::net::SocketAddr>, Refusal) + Send + Sync>;

/// Told of every call the token check admits: a task's `JobEnd` (in `control`) notes when it
/// last heard from its job. A trait here, not the type, so that this module, which every
/// server and client of the crate imports, imports none of them.
pub(crate) trait NoteCalls: Send + Sync {
    /// A call was admitted.
    fn admitted(&self);
}

/// The server side: admits only calls carrying the cluster token.
#[derive(Clone)]
pub struct ServerAuth {
    token: ClusterToken,
    recorder: Option<RefusalRecorder>,
    /// Told of every admitted call.
    calls: Option<Arc<dyn NoteCalls>>,
}

impl ServerAuth {
    /// The same check, also noting every call it admits in `end` (how long a task has heard
    /// nothing from its job).
    pub(crate) fn noting_calls(mut self, end: Arc<dyn NoteCalls>) -> Self {
        self.calls = Some(end);
        self
    }
}

impl std::fmt::Debug for ServerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerAuth").field("token", &self.token).field("records", &self.recorder.is_some()).finish()
    }
}

impl tonic::service::Interceptor for ServerAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let presented = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::as_bytes);
        let refusal = match presented {
            Some(p) if self.token.matches(p) => {
                if let Some(end) = &self.calls {
                    end.admitted();
                }
                return Ok(req);
            }
            Some(_) => Refusal::WrongToken,
            None => Refusal::MissingToken,
        };
        if let Some(record) = &self.recorder {
            let claimed = req
                .metadata()
                .get(TASK_METADATA)
                .and_then(|v| v.to_str().ok())
                .filter(|t| t.len() <= MAX_CLAIMED_TASK)
                .unwrap_or("");
            record(claimed, req.remote_addr(), refusal);
        }
        Err(match refusal {
            Refusal::WrongToken => {
                Status::unauthenticated("wrong cluster token; every task of a job needs the same token")
            }
            Refusal::MissingToken => Status::unauthenticated(
                "missing cluster token: send `authorization: Bearer <token>` (set STRATA_CLUSTER_TOKEN)",
            ),
        })
    }
}

/// The client side: adds the cluster token (and the caller's task name, when it has one) to
/// every call.
#[derive(Clone, Debug)]
pub struct ClientAuth {
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
    task: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for ClientAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.token {
            req.metadata_mut().insert("authorization", h.clone());
        }
        if let Some(t) = &self.task {
            req.metadata_mut().insert(TASK_METADATA, t.clone());
        }
        Ok(req)
    }
}

/// A server interceptor that admits only calls carrying `token`.
pub fn server_interceptor(token: ClusterToken) -> ServerAuth {
    ServerAuth { token, recorder: None, calls: None }
}

/// A server interceptor that admits only calls carrying `token` and tells `recorder` of every
/// call it refuses.
pub fn server_interceptor_recording(token: ClusterToken, recorder: RefusalRecorder) -> ServerAuth {
    ServerAuth { token, recorder: Some(recorder), calls: None }
}

/// A client interceptor that adds `token` to every call.
pub fn client_interceptor(token: ClusterToken) -> ClientAuth {
    ClientAuth { token: token.header(), task: None }
}

/// A client interceptor that adds `token` and the caller's task name (`worker:1`) to every call.
pub fn client_interceptor_as(token: ClusterToken, task: &str) -> ClientAuth {
    ClientAuth { token: token.header(), task: task.parse().ok() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked() {
        assert!(ClusterToken::new("short").is_err());
        assert!(ClusterToken::new("has a space in it 0123").is_err());
        let t = ClusterToken::new("0123456789abcdef0123").unwrap();
        assert!(t.matches(b"0123456789abcdef0123"));
        assert!(!t.matches(b"0123456789abcdef0124"));
        assert!(!t.matches(b"0123456789abcdef012"));
        assert_eq!(format!("{t:?}"), "ClusterToken(<redacted>)");
        use tonic::service::Interceptor;
        let mut admit = server_interceptor(t.clone());
        let mut add = client_interceptor(t);
        assert!(admit.call(add.call(Request::new(())).unwrap()).is_ok());
        let e = admit.call(Request::new(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let mut wrong = client_interceptor(ClusterToken::new("ffffffffffffffffffff").unwrap());
        assert_eq!(admit.call(wrong.call(Request::new(())).unwrap()).unwrap_err().code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn refused_calls_are_recorded_under_the_task_they_claim() {
        let t = ClusterToken::new("0123456789abcdef0123").unwrap();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record: RefusalRecorder = {
            let seen = seen.clone();
            Arc::new(move |task: &str, _, why| seen.lock().unwrap().push((task.to_string(), why)))
        };
        use tonic::service::Interceptor;
        let mut admit = server_interceptor_recording(t.clone(), record);
        let wrong = ClusterToken::new("ffffffffffffffffffff").unwrap();
        let mut as_worker = client_interceptor_as(wrong, "worker:1");
        assert!(admit.call(as_worker.call(Request::new(())).unwrap()).is_err());
        assert!(admit.call(Request::new(())).is_err());
        let mut right = client_interceptor_as(t, "worker:0");
        assert!(admit.call(right.call(Request::new(())).unwrap()).is_ok());
        let mut long = Request::new(());
        long.metadata_mut().insert(TASK_METADATA, "w".repeat(100).parse().unwrap());
        assert!(admit.call(long).is_err());
        assert_eq!(
            *seen.lock().unwrap(),
            [
                ("worker:1".to_string(), Refusal::WrongToken),
                (String::new(), Refusal::MissingToken),
                (String::new(), Refusal::MissingToken)
            ]
        );
    }
}

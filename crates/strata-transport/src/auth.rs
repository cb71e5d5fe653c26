//! The cluster token: how every server of a job tells its own tasks from anyone else.
//!
//! Every RPC carries `authorization: Bearer <token>`; servers compare it in constant time
//! (`subtle`) and answer `UNAUTHENTICATED`, changing nothing, when it is missing or wrong. The
//! token comes from `STRATA_CLUSTER_TOKEN` or a file (`--cluster-token-file`); `strata launch`
//! makes a fresh one for each local job.

use std::path::Path;
use std::sync::Arc;

use subtle::ConstantTimeEq;
use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

use crate::{Error, Result};

/// The environment variable that holds the cluster token.
pub const TOKEN_ENV: &str = "STRATA_CLUSTER_TOKEN";

/// The shortest token accepted (a guessable token makes the cluster public).
pub const MIN_TOKEN_LEN: usize = 16;

/// A cluster's shared secret. Its `Debug` form never shows the secret.
#[derive(Clone)]
pub struct ClusterToken(Arc<str>);

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(<redacted>)")
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
        Ok(Self(t.into()))
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
    /// how to provide one if neither is there.
    pub fn resolve(file: Option<&Path>) -> Result<Self> {
        if let Some(f) = file {
            return Self::from_file(f);
        }
        Self::from_env()?.ok_or_else(|| {
            Error::Config(format!(
                "no cluster token: set {TOKEN_ENV} to the same secret in every task (strata launch does this for you), or pass --cluster-token-file"
            ))
        })
    }

    /// The secret itself, for handshakes that carry it (the data plane's).
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token (constant time in the token's length).
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0.as_bytes().ct_eq(presented).into()
    }

    fn header(&self) -> Option<MetadataValue<tonic::metadata::Ascii>> {
        format!("Bearer {}", self.0).parse().ok()
    }
}

/// The server side: admits only calls carrying the cluster token.
#[derive(Clone, Debug)]
pub struct ServerAuth(ClusterToken);

impl tonic::service::Interceptor for ServerAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let presented = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::as_bytes);
        match presented {
            Some(p) if self.0.matches(p) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong cluster token; every task of a job needs the same token")),
            None => Err(Status::unauthenticated(
                "missing cluster token: send `authorization: Bearer <token>` (set STRATA_CLUSTER_TOKEN)",
            )),
        }
    }
}

/// The client side: adds the cluster token to every call.
#[derive(Clone, Debug)]
pub struct ClientAuth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for ClientAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.0 {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// A server interceptor that admits only calls carrying `token`.
pub fn server_interceptor(token: ClusterToken) -> ServerAuth {
    ServerAuth(token)
}

/// A client interceptor that adds `token` to every call.
pub fn client_interceptor(token: ClusterToken) -> ClientAuth {
    ClientAuth(token.header())
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
}

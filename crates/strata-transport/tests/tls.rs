//! Mutual TLS on a real parameter server over loopback: the cluster's own client (a certificate
//! signed by the cluster's CA) is served; a plaintext client, a client whose certificate another
//! CA signed, a TLS client with no certificate and a client that does not trust the server's CA
//! are all refused with nothing applied, and the server keeps serving. Certificates are made
//! for the test (rcgen); every body runs under a hard limit.

use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use strata_proto::v1::parameter_server_client::ParameterServerClient;
use strata_proto::v1::PsStatusRequest;
use strata_transport::auth::client_interceptor;
use strata_transport::ps::{
    PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle, PushOutcome, ServerOptimizer, UpdateId,
    VariableInfo,
};
use strata_transport::{ClusterToken, Error, MutualTls};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

use crate::common::within_limit;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// A certificate authority: its certificate (PEM) and what signs with it.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        Self { cert: p.self_signed(&key).unwrap(), key }
    }

    fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A task's identity: a certificate for localhost and 127.0.0.1 (server and client use)
    /// signed by this CA, trusting `trusted`.
    fn identity(&self, task: &str, trusted: &Ca) -> MutualTls {
        let mut p = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, task);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        MutualTls::from_pem(trusted.pem(), cert.pem(), key.serialize_pem()).unwrap()
    }
}

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

fn id(worker: &str, step: u64) -> UpdateId {
    UpdateId { worker: worker.into(), client: worker.into(), step, seq: 0 }
}

/// A client that fails at once instead of retrying.
fn client(server: &PsServerHandle, token: ClusterToken) -> PsClient {
    let config = PsClientConfig { timeout: Duration::from_secs(10), retry_for: Duration::ZERO };
    PsClient::connect(&server.address().to_string(), "ps:0", token, config).unwrap()
}

/// (6) Mutual TLS: only the cluster's certificates get through, and each refusal changes
/// nothing.
#[test]
fn mutual_tls_serves_the_clusters_certificates_and_refuses_everyone_else() {
    within_limit("mutual TLS", || {
        let (cluster, other) = (Ca::new("strata cluster CA"), Ca::new("some other CA"));
        let server = PsServerHandle::start(
            "127.0.0.1:0".parse().unwrap(),
            PsServerConfig::new("ps:0", token().with_tls(cluster.identity("ps:0", &cluster))),
        )
        .unwrap();
        let worker = client(&server, token().with_tls(cluster.identity("worker:0", &cluster)));
        let w = VariableInfo::whole("w", vec![4]);
        worker
            .create_variables(&[(w, &[1.0, 2.0, 3.0, 4.0][..])], &ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Async)
            .unwrap();
        assert!(matches!(
            worker.push(&id("worker:0", 0), 0, &[("w", &[1.0; 4])]).unwrap(),
            PushOutcome::Applied { version: 1, duplicate: false }
        ));

        let ones = [1.0f32; 4];
        let refused = |who: &str, c: PsClient| {
            if let Ok(outcome) = c.push(&id(who, 0), 1, &[("w", &ones)]) {
                panic!("{who}: the push was taken ({outcome:?})");
            }
            assert!(c.status().is_err(), "{who} read the task's status");
        };
        refused("plaintext", client(&server, token()));
        refused("another CA's certificate", client(&server, token().with_tls(other.identity("intruder", &cluster))));
        refused("not trusting the server", client(&server, token().with_tls(cluster.identity("worker:1", &other))));

        // TLS that trusts the server but presents no certificate of its own.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let anonymous = rt.block_on(async {
            let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(cluster.pem()));
            let channel =
                Channel::from_shared(format!("https://{}", server.address())).unwrap().tls_config(tls).unwrap();
            match channel.connect().await {
                Err(e) => Err(e.to_string()),
                Ok(ch) => ParameterServerClient::with_interceptor(ch, client_interceptor(token()))
                    .status(PsStatusRequest {})
                    .await
                    .map(|_| ())
                    .map_err(|s| s.to_string()),
            }
        });
        assert!(anonymous.is_err(), "a client without a certificate was served");

        // The right token over the cluster's TLS is still required.
        let wrong_token = ClusterToken::new("ffffffffffffffffffffffffffffffff").unwrap();
        match client(&server, wrong_token.with_tls(cluster.identity("worker:2", &cluster))).status() {
            Err(Error::Unauthenticated(_)) => {}
            other => panic!("a wrong token over TLS: {other:?}"),
        }

        // Nothing of the refused pushes was applied, and the server still serves its cluster.
        let status = worker.status().unwrap();
        assert_eq!((status.version, status.pushes_applied), (1, 1), "{status:?}");
        assert!(matches!(
            worker.push(&id("worker:0", 1), 1, &[("w", &[1.0; 4])]).unwrap(),
            PushOutcome::Applied { version: 2, duplicate: false }
        ));
        assert_eq!(worker.pull(&["w"], 2).unwrap().variables[0].2, vec![-1.0, 0.0, 1.0, 2.0]);
        eprintln!("mutual TLS: the cluster's client served, 5 others refused, the task at version 2");
        server.shutdown();
    });
}

/// The TLS files' errors name the file and what to change.
#[test]
fn tls_files_that_are_missing_or_not_pem_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = MutualTls::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("ca.pem") && e.contains("STRATA_TLS_DIR needs ca.pem, cert.pem and key.pem"), "{e}");
    let ca = Ca::new("ca");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.path().join("cert.pem"), "not a certificate").unwrap();
    std::fs::write(dir.path().join("key.pem"), KeyPair::generate().unwrap().serialize_pem()).unwrap();
    let e = MutualTls::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("the certificate is not PEM"), "{e}");
    assert!(format!("{:?}", token().with_tls(ca.identity("t", &ca))).contains("<redacted>, mutual TLS"));
}

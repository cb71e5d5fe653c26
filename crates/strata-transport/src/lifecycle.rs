//! The lifecycle of this crate's gRPC servers (the parameter server, the worker executor, the
//! coordination service): bind a listener, serve on the transport runtime behind the cluster
//! token with a health service, stop on request or when the job's chief ends the job
//! ([`ServerHandle::finished`]).

use std::future::Future;
use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::rt::runtime;
use crate::{Error, Result};

/// Binds a listener for a server (`what`: "the parameter server ps:0") on `bind` (port 0 picks
/// a free one) and reads the address it got. Must not be called from inside the runtime.
pub(crate) fn listen(bind: SocketAddr, what: &str) -> Result<(TcpListener, SocketAddr)> {
    let listener = runtime().block_on(TcpListener::bind(bind)).map_err(|e| Error::bind(what, bind, e))?;
    let address = listener.local_addr().map_err(|e| Error::io(format!("reading the address of {what}"), e))?;
    Ok((listener, address))
}

/// What a server's body gets: the connections to serve, and the future that completes when the
/// server must stop (pass both to `serve_with_incoming_shutdown`).
pub(crate) type Serve = (
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send>>,
    std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
);

/// The health service every server carries, behind the cluster token.
pub(crate) type Health = tonic::service::interceptor::InterceptedService<
    crate::guard::DecodeErrors<tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>>,
    crate::auth::ServerAuth,
>;

/// Runs a gRPC server on the transport runtime: `body` gets the health service (which reports
/// service `S` serving, behind `auth`; undecodable requests answer `INVALID_ARGUMENT`) and builds the server, serving the connections of
/// `listener` (Nagle's algorithm off) until `stop` turns true (the returned [`ServerTask`]
/// turns it); a server that ends with an error logs it as `what`. Every server of this crate
/// starts and stops here.
pub(crate) fn spawn_server<S, F, Fut>(
    listener: TcpListener,
    what: String,
    stop: tokio::sync::watch::Sender<bool>,
    auth: crate::auth::ServerAuth,
    body: F,
) -> ServerTask
where
    S: tonic::server::NamedService,
    F: FnOnce(Health, Serve) -> Fut + Send + 'static,
    Fut: Future<Output = std::result::Result<(), tonic::transport::Error>> + Send + 'static,
{
    let mut rx = stop.subscribe();
    let done = runtime().spawn(async move {
        let reporter = tonic_health::server::HealthReporter::new();
        reporter.set_serving::<S>().await;
        let health = tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(reporter),
        );
        let shutdown = Box::pin(async move {
            let _ = rx.wait_for(|s| *s).await;
        });
        let health = tonic::service::interceptor::InterceptedService::new(crate::guard::DecodeErrors(health), auth);
        if let Err(e) = body(health, (Box::pin(incoming(listener)), shutdown)).await {
            tracing::error!(server = %what, error = %e, "a server stopped");
        }
    });
    ServerTask::new(stop, done)
}

/// A running server of one task: where it listens and the switch that stops it. The handles of
/// the parameter server and of the worker executor are this type, told apart by `K`, each with
/// its own `start`.
pub struct ServerHandle<K> {
    address: SocketAddr,
    task: String,
    server: ServerTask,
    /// The job's end as the task's `TaskControl` service hears it (ps and worker tasks).
    end: Option<std::sync::Arc<crate::control::JobEnd>>,
    kind: std::marker::PhantomData<fn() -> K>,
}

impl<K> std::fmt::Debug for ServerHandle<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle").field("task", &self.task).field("address", &self.address).finish()
    }
}

impl<K> ServerHandle<K> {
    pub(crate) fn new(address: SocketAddr, task: String, server: ServerTask) -> Self {
        Self { address, task, server, end: None, kind: std::marker::PhantomData }
    }

    /// The same handle, serving `TaskControl` with `end`.
    pub(crate) fn with_end(mut self, end: std::sync::Arc<crate::control::JobEnd>) -> Self {
        self.end = Some(end);
        self
    }

    /// Why the job is over, once its chief said so with `Finish`
    /// ([`finish_task`](crate::control::finish_task)): the program stops serving and exits 0.
    /// Always `None` for a server without `TaskControl` (the coordination service).
    pub fn finished(&self) -> Option<String> {
        self.end.as_ref().and_then(|e| e.finished())
    }

    /// Serves until the job's chief ends it ([`finished`](Self::finished)), then stops serving
    /// and returns the chief's reason: what a ps task's or a worker's `main` does last. A
    /// server without `TaskControl` (the coordination service) serves until the process ends.
    pub fn wait_finished(self) -> String {
        loop {
            if let Some(why) = self.finished() {
                self.shutdown();
                return why;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// How long since the server last admitted a call (the chief probes every ps task and
    /// worker twice a second); `None` before the first, and for a server without
    /// `TaskControl`.
    pub fn idle_for(&self) -> Option<std::time::Duration> {
        self.end.as_ref().and_then(|e| e.idle_for())
    }

    /// Where the server listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops serving and returns when the server task ended (open calls get up to 5 s).
    pub fn shutdown(mut self) {
        self.server.stop();
    }

    /// Blocks until the server stops.
    pub fn wait(mut self) {
        self.server.wait();
    }
}

/// A server running on the transport runtime, with the switch that stops it: the handles of the
/// parameter server, the worker executor and the coordination service hold one. Dropping it
/// stops the server.
pub(crate) struct ServerTask {
    stop: Option<tokio::sync::watch::Sender<bool>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

impl ServerTask {
    /// A server task `done` that ends once `stop` turns true.
    fn new(stop: tokio::sync::watch::Sender<bool>, done: tokio::task::JoinHandle<()>) -> Self {
        Self { stop: Some(stop), done: Some(done) }
    }

    /// Asks the server to stop and waits (up to 5 s) for it to end.
    pub(crate) fn stop(&mut self) {
        self.stop_within(std::time::Duration::from_secs(5));
    }

    /// Asks the server to stop, waits up to `grace` for its graceful shutdown, then drops it.
    /// A graceful HTTP/2 shutdown waits for every client to acknowledge it, which a stopped or
    /// cut-off client never does: after a failure, stop with a short grace.
    pub(crate) fn stop_within(&mut self, grace: std::time::Duration) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(true);
        }
        if let Some(mut done) = self.done.take() {
            let ended = runtime().block_on(async { tokio::time::timeout(grace, &mut done).await.is_ok() });
            if !ended {
                done.abort();
                tracing::debug!(?grace, "a server did not stop gracefully in time; dropped it");
            }
        }
    }

    /// Blocks until the server ends.
    pub(crate) fn wait(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = runtime().block_on(done);
        }
    }
}

impl std::fmt::Debug for ServerTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTask").field("running", &self.done.is_some()).finish()
    }
}

impl Drop for ServerTask {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The connections `listener` accepts, with Nagle's algorithm off: tonic's own `tcp_nodelay`
/// applies only to the listeners it binds, and a small reply held back for a delayed ACK
/// costs 40 ms.
fn incoming(listener: TcpListener) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|s| {
            if let Err(e) = s.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
            }
        })
    })
}

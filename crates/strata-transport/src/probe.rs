//! Transport probes for `strata bench transport`: one-way throughput of a gRPC client stream
//! (tonic, 1 MiB messages, large HTTP/2 windows, the cluster token checked on the call) and of
//! one raw TCP connection, on loopback, in the same run. The data plane's choice of raw TCP
//! rests on these figures.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use strata_proto::v1::transport_bench_client::TransportBenchClient;
use strata_proto::v1::transport_bench_server::{TransportBench, TransportBenchServer};
use strata_proto::v1::{BenchChunk, BenchSinkReply};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{client_interceptor, server_interceptor, ClusterToken};
use crate::rt::runtime;
use crate::{Error, Result};

#[derive(Debug, Default)]
struct Sink;

#[tonic::async_trait]
impl TransportBench for Sink {
    async fn sink(&self, req: Request<Streaming<BenchChunk>>) -> std::result::Result<Response<BenchSinkReply>, Status> {
        let mut s = req.into_inner();
        let mut bytes = 0u64;
        while let Some(c) = s.next().await {
            bytes += c?.data.len() as u64;
        }
        Ok(Response::new(BenchSinkReply { bytes }))
    }
}

/// Sends `total` bytes in `chunk`-byte messages over one gRPC client stream on loopback;
/// returns the seconds it took (median of `reps`).
pub fn grpc_stream_seconds(total: usize, chunk: usize, reps: usize) -> Result<f64> {
    let token = ClusterToken::new("probe-token-0123456789")?;
    let listener = runtime()
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(|e| Error::io("binding the probe server", e))?;
    let addr = listener.local_addr().map_err(|e| Error::io("probe address", e))?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = runtime().spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(Some(16 << 20))
            .initial_connection_window_size(Some(64 << 20))
            .max_frame_size(crate::rt::frame_size())
            .add_service(tonic::service::interceptor::InterceptedService::new(
                TransportBenchServer::new(Sink).max_decoding_message_size(chunk + 1024),
                server_interceptor(token.clone()),
            ))
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async {
                let _ = rx.await;
            }),
    );
    let result = runtime().block_on(async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .map_err(|e| Error::Config(e.to_string()))?
            .initial_stream_window_size(Some(16 << 20))
            .initial_connection_window_size(Some(64 << 20))
            .max_frame_size(crate::rt::frame_size())
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| Error::Rpc { rpc: "connect".into(), peer: addr.to_string(), status: e.to_string() })?;
        let mut client = TransportBenchClient::with_interceptor(channel, client_interceptor(token))
            .max_encoding_message_size(chunk + 1024);
        let payload = bytes_of(chunk);
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let n = total.div_ceil(chunk.max(1));
            let p = payload.clone();
            let stream = tokio_stream::iter((0..n).map(move |_| BenchChunk { data: p.clone() }));
            let t0 = Instant::now();
            let got = client.sink(stream).await.map_err(|s| Error::Rpc {
                rpc: "Sink".into(),
                peer: addr.to_string(),
                status: s.to_string(),
            })?;
            times.push(t0.elapsed().as_secs_f64());
            if got.into_inner().bytes != (n * chunk) as u64 {
                return Err(Error::Protocol { peer: addr.to_string(), detail: "the sink lost bytes".into() });
            }
        }
        Ok(median(times))
    });
    let _ = tx.send(());
    let _ = runtime().block_on(async { tokio::time::timeout(Duration::from_secs(5), server).await });
    result
}

/// Sends `total` bytes in `chunk`-byte writes over one raw TCP connection on loopback (the
/// receiver reads into a reused buffer); returns the seconds it took (median of `reps`).
pub fn tcp_seconds(total: usize, chunk: usize, reps: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("binding the probe listener", e))?;
    let addr: SocketAddr = listener.local_addr().map_err(|e| Error::io("probe address", e))?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 4 << 20];
        loop {
            match s.read(&mut buf)? {
                0 => return Ok(()),
                _ => continue,
            }
        }
    });
    let mut s = TcpStream::connect(addr).map_err(|e| Error::io("connecting the probe", e))?;
    s.set_nodelay(true).map_err(|e| Error::io("nodelay", e))?;
    let payload = vec![7u8; chunk.max(1)];
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        let mut sent = 0;
        while sent < total {
            let n = payload.len().min(total - sent);
            s.write_all(&payload[..n]).map_err(|e| Error::io("probe write", e))?;
            sent += n;
        }
        s.flush().map_err(|e| Error::io("probe flush", e))?;
        times.push(t0.elapsed().as_secs_f64());
    }
    drop(s);
    let _ = reader.join();
    Ok(median(times))
}

fn bytes_of(n: usize) -> prost::bytes::Bytes {
    prost::bytes::Bytes::from(vec![7u8; n])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

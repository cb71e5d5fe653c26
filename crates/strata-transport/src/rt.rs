//! The tokio runtime the transport's servers and clients run on, and the HTTP/2 frame size
//! they share. Strata's strategies are synchronous (replica threads), so they call into it with
//! `block_on` from their own threads. The servers' lifecycle (bind, serve, stop) is
//! [`lifecycle`](crate::lifecycle)'s.

use std::sync::OnceLock;

use tokio::runtime::Runtime;

/// The process-wide transport runtime (two worker threads: the data plane does not run here).
pub fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("strata-transport")
            .enable_all()
            .build()
            .unwrap_or_else(|e| {
                // Without a runtime no transport works at all; there is nothing to recover.
                eprintln!("strata: cannot start the transport runtime: {e}");
                std::process::exit(1)
            })
    })
}

/// The HTTP/2 frame size servers and clients of tensors accept: a 1 MiB chunk and its framing
/// in one DATA frame. 16 KiB frames (HTTP/2's default) cut a chunk into 64 frames and cap a
/// stream at about 40% of raw loopback TCP; 256 KiB frames (four a chunk) left pushes of 16 and
/// 64 MiB at 58-68% of raw TCP in `strata bench ps`, one frame a chunk at 74-92% (same runs).
pub const MAX_FRAME_SIZE: u32 = (1 << 20) + (64 << 10);

/// The frame size, or `STRATA_HTTP2_FRAME` (bytes) when set (for measurements).
pub(crate) fn frame_size() -> u32 {
    std::env::var("STRATA_HTTP2_FRAME")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MAX_FRAME_SIZE)
        .clamp(16 << 10, (16 << 20) - 1)
}

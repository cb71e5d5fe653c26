//! The tokio runtime the transport's servers and clients run on. Strata's strategies are
//! synchronous (replica threads), so they call into it with `block_on` from their own threads.

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

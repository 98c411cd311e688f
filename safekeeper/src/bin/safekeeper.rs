//! The safekeeper daemon: flags, logging, allocator, then `safekeeper::daemon::run`.

use clap::Parser;
use safekeeper::config::Conf;
use safekeeper::daemon;

profiling::global_allocator!();

fn main() {
    let conf = Conf::parse();
    safekeeper::logging::init(conf.log_format);
    // Before any other thread exists: see profiling::warm_up.
    profiling::warm_up();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("safekeeper-worker")
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| {
            runtime.block_on(async move {
                let listeners = daemon::bind(&conf).await?;
                daemon::run(conf, listeners, daemon::shutdown_signal()).await
            })
        });
    if let Err(e) = result {
        tracing::error!("{e:#}");
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

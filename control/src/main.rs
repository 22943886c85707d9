//! `felix-controlplane`: the Felix control plane process.

use felix_control::config::{Config, LogFormat, StoreKind};
use felix_control::linger::LingerListener;
use felix_control::server::{serve, AppState};
use felix_control::store::memory::MemoryStore;
use felix_control::store::MetadataStore;
use std::sync::Arc;

#[tokio::main]
async fn main() {
    let cfg = match Config::load_from(std::env::args_os()) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("felix-controlplane: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = cfg.check() {
        eprintln!("felix-controlplane: {e}");
        std::process::exit(2);
    }
    if cfg.print_config {
        println!(
            "{}",
            serde_json::to_string_pretty(&*cfg).expect("config serializes")
        );
        return;
    }
    let b = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FELIX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn")),
        )
        // Colour only for a person at a terminal; a pipe, a file or the journal gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match cfg.log_format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
    std::process::exit(run(cfg).await);
}

async fn run(cfg: Arc<Config>) -> i32 {
    let tls = match felix_control::https::prepare(&cfg) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("felix-controlplane: {e}");
            return 2;
        }
    };
    let listener = match tokio::net::TcpListener::bind(cfg.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("felix-controlplane: cannot listen on {}: {e}", cfg.listen);
            return 1;
        }
    };
    let (store, extra): (Arc<dyn MetadataStore>, axum::Router) = match cfg.store_kind() {
        StoreKind::Memory => (
            Arc::new(MemoryStore::new(cfg.limits(), cfg.placement_settle_ms > 0)),
            axum::Router::new(),
        ),
        StoreKind::Raft => match felix_control::raft::open(cfg.clone()).await {
            Ok((s, r)) => (s, r),
            Err(e) => {
                eprintln!("felix-controlplane: {e}");
                return 1;
            }
        },
    };
    let st = AppState::new(store.clone(), cfg.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let drain_st = st.clone();
    let drain_ms = cfg.drain_timeout_ms;
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("sigterm");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        // Drain: readiness off and long polls answered, then stop accepting and let the
        // requests in flight finish, within one deadline; a second signal forces.
        drain_st.drain();
        let _ = stop_tx.send(true);
        tokio::select! {
            _ = tokio::signal::ctrl_c() => eprintln!("felix-controlplane: second signal; forced exit"),
            _ = term.recv() => eprintln!("felix-controlplane: second signal; forced exit"),
            _ = tokio::time::sleep(std::time::Duration::from_millis(drain_ms)) => {
                eprintln!("felix-controlplane: drain deadline ({drain_ms} ms) passed; forced exit")
            }
        }
        std::process::exit(3);
    });
    if cfg.auth == felix_control::config::AuthSwitch::Off {
        tracing::warn!("auth is off (--auth off): anyone who reaches {} may read and change every tenant, broker and token", cfg.listen);
    }
    tracing::info!(listen = %cfg.listen, scheme = cfg.scheme(), store = ?cfg.store_kind(), "felix-controlplane serving");
    // Machine-readable line for tests and scripts.
    println!(
        "listening {}",
        listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    );
    let r = match tls {
        // Every connection closes lingering: a refusal before the body was read must reach a
        // client that is still sending it (control/src/linger.rs).
        None => serve(LingerListener(listener), st, extra, stop_rx).await,
        Some(server) => {
            let limits = felix_control::https::HandshakeLimits {
                timeout: std::time::Duration::from_millis(cfg.tls_handshake_timeout_ms),
                in_flight_max: cfg.tls_handshakes_max,
            };
            match felix_control::https::TlsListener::new(listener, server, limits) {
                Ok(l) => serve(LingerListener(l), st, extra, stop_rx).await,
                Err(e) => Err(e),
            }
        }
    };
    store.shutdown().await;
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("felix-controlplane: {e}");
            1
        }
    }
}

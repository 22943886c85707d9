use clap::Parser;
use felix_broker::catalog::{Catalog, CatalogCell};
use felix_broker::config::{Config, Flags};
use felix_broker::core::{run_core, CoreSettings, MeshMsg, PeerSockets};
use felix_broker::metrics::{self, CoreCounters, Ops};
use felix_quic::tls::{self, CertPaths, TransportConfig};
use glommio::channels::channel_mesh::MeshBuilder;
use glommio::{LocalExecutorBuilder, Placement};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn init_logs(json: bool) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // Colour only for a person at a terminal; a pipe, a file or the journal gets plain text.
    use std::io::IsTerminal;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("inspect") {
        init_logs(false);
        std::process::exit(felix_broker::inspect::main(&args[2..]));
    }
    if args.get(1).map(String::as_str) == Some("dev-certs") {
        std::process::exit(dev_certs(&args[2..]));
    }
    if args.get(1).map(String::as_str) == Some("token") {
        std::process::exit(felix_broker::auth::token_command(&args[2..]));
    }
    if args.get(1).map(String::as_str) == Some("restore-point") {
        std::process::exit(felix_broker::storage_identity::restore_point_command(
            &args[2..],
        ));
    }
    let flags = Flags::parse();
    let cfg = match Config::resolve(&flags) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("felix-broker: invalid configuration: {e}");
            std::process::exit(2);
        }
    };
    init_logs(cfg.log_format == "json");
    if flags.print_config {
        println!("{}", serde_json::to_string_pretty(&cfg).unwrap());
        return;
    }
    // A missing or unreadable credential or CA is a configuration error: exit 2, which the
    // packaged unit does not restart (it would fail the same way every 2 s).
    let creds = felix_broker::auth::node_token(&cfg).and_then(|t| {
        let ca = cfg
            .controlplane_ca
            .as_deref()
            .map(felix_broker::control_link::load_ca)
            .transpose()?;
        Ok((t, ca))
    });
    let creds = match creds {
        Ok(c) => c,
        Err(e) => {
            eprintln!("felix-broker: invalid configuration: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(cfg, creds) {
        eprintln!("felix-broker: {e}");
        std::process::exit(1);
    }
}

/// `felix-broker dev-certs DIR NODE_ID...`: a cluster CA (kept if DIR has one) and a peer
/// certificate per node, for a local cluster (`scripts/dev-certs.sh`).
fn dev_certs(args: &[String]) -> i32 {
    let usage = "usage: felix-broker dev-certs DIR NODE_ID [NODE_ID...]";
    let Some((dir, ids)) = args.split_first() else {
        eprintln!("{usage}");
        return 2;
    };
    let ids: Result<Vec<u64>, _> = ids.iter().map(|s| s.parse::<u64>()).collect();
    match ids {
        Ok(ids) if !ids.is_empty() && ids.iter().all(|&i| i > 0) => {
            match tls::generate_cluster_certs(std::path::Path::new(dir), &ids) {
                Ok(made) => {
                    for (id, t) in ids.iter().zip(made) {
                        println!(
                            "node {id}: cert {} key {} ca {}",
                            t.cert.cert.display(),
                            t.cert.key.display(),
                            t.ca.display()
                        );
                    }
                    0
                }
                Err(e) => {
                    eprintln!("felix-broker dev-certs: {e}");
                    1
                }
            }
        }
        _ => {
            eprintln!("node ids are numbers of at least 1; {usage}");
            2
        }
    }
}

/// The node credential and the control plane's CA, read before anything starts.
type Credentials = (
    Option<felix_broker::auth::Secret>,
    Option<Vec<reqwest::Certificate>>,
);

fn run(cfg: Config, (node_token, controlplane_ca): Credentials) -> Result<(), String> {
    let cfg = Arc::new(cfg);
    let standalone = cfg.controlplane_url.is_none();
    let catalog = match &cfg.catalog {
        // With a control plane the catalog starts empty and the ops thread fills it.
        _ if !standalone => Catalog::default(),
        Some(p) => Catalog::from_yaml(
            &std::fs::read_to_string(p).map_err(|e| format!("catalog {}: {e}", p.display()))?,
        )
        .map_err(|e| format!("catalog {}: {e}", p.display()))?,
        None => Catalog::default_catalog(),
    };
    if cfg.durable_storage_dir.is_none() {
        if let Some(d) = catalog.streams().find(|d| d.durable) {
            return Err(format!(
                "stream {} is durable but no durable storage directory is set (durable_storage_dir / FELIX_DURABLE_STORAGE_DIR)",
                d.name()
            ));
        }
    }
    // The durable directory's storage identity (replication rule 9), settled before any log
    // opens: kept across a clean stop or a process crash on this boot, rotated on doubt.
    let identity = match &cfg.durable_storage_dir {
        Some(dir) => {
            use felix_broker::storage_identity as si;
            let (rec, why) =
                si::open(dir).map_err(|e| format!("storage identity in {}: {e}", dir.display()))?;
            if why.rotated() {
                tracing::warn!(dir = %dir.display(), identity = %rec.id, why = why.as_str(), "storage identity rotated");
            } else {
                tracing::info!(dir = %dir.display(), identity = %rec.id, why = why.as_str(), "storage identity");
            }
            Some((dir.clone(), rec.id))
        }
        None => None,
    };
    let catalog = Arc::new(CatalogCell::new(catalog));
    let cert = match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(c), Some(k)) => CertPaths {
            cert: c.clone(),
            key: k.clone(),
        },
        _ => {
            let (p, created) =
                tls::ensure_dev_cert(&cfg.data_dir.join("tls")).map_err(|e| e.to_string())?;
            if created {
                tracing::info!(cert = %p.cert.display(), "generated self-signed development certificate");
            }
            p
        }
    };
    let transport = TransportConfig {
        idle_timeout_ms: cfg.idle_timeout_ms,
        udp_payload_max_bytes: cfg.udp_payload_max_bytes,
        ..Default::default()
    };
    // Validate TLS files before starting cores, so a bad file is one clear error.
    tls::server_config(&cert, &transport).map_err(|e| e.to_string())?;
    let peer_tls = match (&cfg.peer_cert, &cfg.peer_key, &cfg.peer_ca) {
        (Some(c), Some(k), Some(ca)) => {
            let t = tls::PeerTls {
                cert: CertPaths {
                    cert: c.clone(),
                    key: k.clone(),
                },
                ca: ca.clone(),
            };
            tls::peer_server_config(&t, &transport)
                .and_then(|_| tls::peer_client_config(&t, &transport))
                .map_err(|e| format!("peer TLS: {e}"))?;
            let der = std::fs::read(c).map_err(|e| format!("peer_cert {}: {e}", c.display()))?;
            let names = tls::pem_dns_names(&der);
            let want = tls::node_name(cfg.node_id);
            if !names.contains(&want) {
                return Err(format!(
                    "peer_cert {} names {names:?}, not {want} (this broker's node_id): other brokers would refuse it",
                    c.display()
                ));
            }
            Some(t)
        }
        _ => None,
    };

    // Block SIGTERM/SIGINT in every thread; the main thread waits for them with sigwait.
    let sigset = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };

    let mut sockets = Vec::new();
    let mut listen = cfg.listen;
    for i in 0..cfg.cores {
        let s = felix_quic::glommio_driver::bind_reuseport(listen, 8 << 20)
            .map_err(|e| format!("bind {listen}: {e}"))?;
        if i == 0 {
            // With port 0 the first socket picks the port; the others join it.
            listen = s
                .local_addr()
                .ok()
                .and_then(|a| a.as_socket())
                .unwrap_or(listen);
        }
        sockets.push(s);
    }
    // The peer listener: one SO_REUSEPORT socket per core, and one dial socket per core.
    let mut peer_sockets: Vec<Option<(socket2::Socket, socket2::Socket)>> = Vec::new();
    let mut peer_listen = cfg.peer_listen;
    for i in 0..cfg.cores {
        let Some(addr) = peer_listen else {
            peer_sockets.push(None);
            continue;
        };
        let l = felix_quic::glommio_driver::bind_reuseport(addr, 8 << 20)
            .map_err(|e| format!("bind peer_listen {addr}: {e}"))?;
        if i == 0 {
            peer_listen = l
                .local_addr()
                .ok()
                .and_then(|a| a.as_socket())
                .or(peer_listen);
        }
        let dial_addr = std::net::SocketAddr::new(addr.ip(), 0);
        let d = felix_quic::glommio_driver::bind_reuseport(dial_addr, 8 << 20)
            .map_err(|e| format!("bind a dial socket on {dial_addr}: {e}"))?;
        peer_sockets.push(Some((l, d)));
    }
    let metrics_listener = std::net::TcpListener::bind(cfg.metrics_listen)
        .map_err(|e| format!("bind {}: {e}", cfg.metrics_listen))?;
    let metrics_addr = metrics_listener.local_addr().map_err(|e| e.to_string())?;
    let counters: Vec<Arc<CoreCounters>> = (0..cfg.cores)
        .map(|_| Arc::new(CoreCounters::default()))
        .collect();
    let shard_metrics = Arc::new(metrics::ShardMetrics::default());
    let auth = felix_broker::auth::setup(&cfg)?;
    let ops = Arc::new(Ops {
        cores: counters.clone(),
        shards: shard_metrics.clone(),
        ready: AtomicBool::new(false),
        auth: auth.clone(),
        metrics_public: cfg.metrics_public,
    });
    metrics::serve(metrics_listener, ops.clone());

    let shutdown = Arc::new(AtomicBool::new(false));
    // Without a control plane there is no revocation feed: the data dir's revocation file
    // stands in for it.
    let local_auth = matches!(felix_broker::auth::mode(&cfg), "standalone" | "jwks");
    if let Some(keys) = auth.clone().filter(|_| local_auth) {
        use felix_broker::auth::local_revocations::{follow, revocations_path};
        follow(revocations_path(&cfg.data_dir), keys, shutdown.clone());
    }
    let drain_forced = Arc::new(AtomicBool::new(false));
    let log_close_failed = Arc::new(AtomicBool::new(false));
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let drain_idle: Arc<Vec<AtomicBool>> =
        Arc::new((0..cfg.cores).map(|_| AtomicBool::new(false)).collect());
    let mesh = MeshBuilder::<MeshMsg, _>::full(cfg.cores, 1024);
    // Executor i on the i-th CPU of the allowed set (or of cpu_list), never on CPU i blindly.
    let cpus = cfg.executor_cpus()?;
    match &cpus {
        Some(c) => tracing::info!(
            cpus = %felix_broker::config::format_cpu_list(c),
            "executors pinned one per CPU"
        ),
        None => tracing::info!(
            cores = cfg.cores,
            allowed = %felix_broker::config::format_cpu_list(&felix_broker::config::allowed_cpus()),
            "more cores than allowed CPUs: executors run unpinned within the allowed set"
        ),
    }
    // Replica reports between the cores and the control-plane link (none standalone).
    let reports =
        (!standalone).then(|| Arc::new(felix_broker::replica_reports::ReportBox::new(cfg.cores)));
    let mut handles = Vec::new();
    for (i, (sock, peer_socks)) in sockets.into_iter().zip(peer_sockets).enumerate() {
        let mesh = mesh.clone();
        let cert = cert.clone();
        let peer_tls = peer_tls.clone();
        let transport = transport.clone();
        let settings = CoreSettings {
            cores: cfg.cores as u8,
            cfg: cfg.clone(),
            catalog: catalog.clone(),
            counters: counters[i].clone(),
            shard_metrics: shard_metrics.clone(),
            shutdown: shutdown.clone(),
            drain_forced: drain_forced.clone(),
            log_close_failed: log_close_failed.clone(),
            started: started.clone(),
            drain_idle: drain_idle.clone(),
            auth: auth.clone(),
            reports: reports.clone(),
        };
        let placement = match &cpus {
            Some(c) => Placement::Fixed(c[i]),
            None => Placement::Unbound,
        };
        let seed_dir = cfg
            .durable_storage_dir
            .clone()
            .unwrap_or_else(|| cfg.data_dir.clone());
        let h = LocalExecutorBuilder::new(placement)
            .name(&format!("felix-core-{i}"))
            .io_memory(cfg.io_memory_bytes)
            .spin_before_park(std::time::Duration::from_micros(cfg.spin_before_park_us))
            .spawn(move || async move {
                if let Err(e) = felix_storage::seed_dma_probe(&seed_dir).await {
                    tracing::warn!(error = %e, "DMA probe seed failed; durable reads may fail");
                }
                let qc = tls::server_config(&cert, &transport).expect("validated at start");
                let peer = match (peer_socks, &peer_tls) {
                    (Some((listen, dial)), Some(t)) => Some(PeerSockets {
                        listen,
                        dial,
                        server: tls::peer_server_config(t, &transport).expect("validated at start"),
                        client: tls::peer_client_config(t, &transport).expect("validated at start"),
                    }),
                    _ => None,
                };
                let mesh = mesh.join().await.expect("core mesh join");
                run_core(sock, qc, settings, mesh, peer).await;
            })
            .map_err(|e| format!("start core {i}: {e}"))?;
        handles.push(h);
    }
    // Ready once every core has opened its durable logs and serves and, with a control plane,
    // once its catalog has been read.
    let synced = Arc::new(AtomicBool::new(standalone));
    if let Some(url) = &cfg.controlplane_url {
        let quic_addr = match &cfg.advertise_addr {
            Some(a) => a.clone(),
            None if listen.ip().is_unspecified() => {
                format!("127.0.0.1:{}", listen.port())
            }
            None => listen.to_string(),
        };
        felix_broker::control_link::spawn(
            felix_broker::control_link::LinkConfig {
                url: url.clone(),
                node_id: cfg.node_id,
                quic_addr,
                cores: cfg.cores as u32,
                wait_ms: cfg.controlplane_wait_ms,
                peer_addr: peer_listen.map(|l| match &cfg.peer_advertise_addr {
                    Some(a) => a.clone(),
                    None if l.ip().is_unspecified() => format!("127.0.0.1:{}", l.port()),
                    None => l.to_string(),
                }),
                token: node_token,
                token_file: cfg.controlplane_token_file.clone(),
                keys: auth
                    .clone()
                    .filter(|_| felix_broker::auth::mode(&cfg) == "controlplane"),
                jwks_refresh_ms: cfg.auth_jwks_refresh_ms,
                ca: controlplane_ca.unwrap_or_default(),
                storage_id: identity.as_ref().map(|(_, id)| id.clone()),
                reports: reports.clone(),
            },
            catalog.clone(),
            synced.clone(),
            shutdown.clone(),
        )
        .map_err(|e| format!("start the control-plane link: {e}"))?;
    }
    let mut announced = false;
    let sig = loop {
        if !announced
            && auth.as_ref().is_none_or(|k| k.loaded())
            && synced.load(Ordering::Acquire)
            && started.load(Ordering::Acquire) == cfg.cores
        {
            announced = true;
            ops.ready.store(true, Ordering::Release);
            let peer = peer_listen
                .map(|p| format!(" peer={p}"))
                .unwrap_or_default();
            println!(
                "felix-broker ready quic={listen} metrics={metrics_addr} cores={}{peer}",
                cfg.cores
            );
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
        // Poll quickly until ready; once ready, sleep until a signal. This thread shares the
        // process's CPUs with the cores: a periodic wake-up would preempt a core's executor
        // (measured: ~10 preemptions a second of ~40 µs each with a 100 ms poll).
        let r = if announced {
            unsafe { libc::sigwaitinfo(&sigset, std::ptr::null_mut()) }
        } else {
            let ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 5_000_000,
            };
            unsafe { libc::sigtimedwait(&sigset, std::ptr::null_mut(), &ts) }
        };
        if r > 0 {
            break r;
        }
    };
    tracing::info!(signal = sig, "shutting down");
    ops.ready.store(false, Ordering::Release);
    shutdown.store(true, Ordering::Release);
    // The cores drain within drain_timeout_ms; a second signal or the deadline (plus a grace
    // second) forces the exit, reported by exit code 3.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for h in handles {
            let _ = h.join();
        }
        let _ = done_tx.send(());
    });
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(cfg.drain_timeout_ms + 1_000);
    loop {
        if done_rx.try_recv().is_ok() {
            if drain_forced.load(Ordering::Acquire) {
                eprintln!(
                    "felix-broker: drain deadline passed with publishes unanswered; forced exit"
                );
                std::process::exit(3);
            }
            // Every core closed its logs (flushed and fsynced): the next start may keep the
            // storage identity whatever happens to the machine meanwhile.
            if let Some((dir, id)) = &identity {
                if log_close_failed.load(Ordering::Acquire) {
                    tracing::warn!(
                        "a durable log failed to close: the stop is not recorded as clean"
                    );
                } else if let Err(e) = felix_broker::storage_identity::mark_clean(dir, id) {
                    tracing::error!(error = %e, "could not record the clean stop in the storage identity");
                }
            }
            if !standalone {
                felix_broker::control_link::wait_for_leave();
            }
            tracing::info!("shutdown complete");
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            eprintln!("felix-broker: shutdown deadline passed; forced exit");
            std::process::exit(3);
        }
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 20_000_000,
        };
        let r = unsafe { libc::sigtimedwait(&sigset, std::ptr::null_mut(), &ts) };
        if r > 0 {
            eprintln!("felix-broker: second signal {r}; forced exit");
            std::process::exit(3);
        }
    }
}

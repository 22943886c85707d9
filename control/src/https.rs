//! HTTPS on the REST listener: the rustls server configuration from PEM files, a listener
//! that hands axum only completed handshakes, and the HTTP client a member uses to call the
//! others (Raft RPCs, forwarding to the leader) trusting the configured CA.
//!
//! The handshake runs in its own task per connection, bounded in time and in number, so a
//! client that opens a TCP connection and never speaks cannot stall `accept` for everyone.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

/// Handshakes that failed or timed out since start (`/metrics`:
/// `felix_controlplane_tls_handshake_failures_total`).
pub static HANDSHAKE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// A rustls server configuration from a PEM certificate chain (leaf first) and a PEM private
/// key (PKCS#8, SEC1 or PKCS#1). Errors name the file.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| format!("TLS certificate {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "TLS certificate {}: no PEM certificate in it",
            cert.display()
        ));
    }
    let private =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("TLS key {}: {e}", key.display()))?;
    // ring, not aws-lc: aws-lc would be a second C build beside BoringSSL. rustls 0.23.48
    // deprecates ring's provider for lacking post-quantum key exchange; the REST listener
    // accepts that until the QUIC side (BoringSSL) and this one move together.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, private)
        .map_err(|e| {
            format!(
                "TLS certificate {} with key {}: {e}",
                cert.display(),
                key.display()
            )
        })?;
    // axum serves HTTP/1.1 here (its http2 feature is off).
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// What `--tls on` serves: the configured certificate, or the development one (made under
/// the data dir's `tls/` on first use). `None` with `--tls off`. Runs before the listener
/// opens, so a bad file stops the start with its name.
pub fn prepare(cfg: &crate::config::Config) -> Result<Option<Arc<rustls::ServerConfig>>, String> {
    use crate::config::TlsSwitch;
    if cfg.tls == TlsSwitch::Off {
        return Ok(None);
    }
    let (cert, key) = match (&cfg.tls_cert_file, &cfg.tls_key_file) {
        (Some(c), Some(k)) => (c.clone(), k.clone()),
        _ => {
            let dir = cfg
                .tls_dir()
                .ok_or("--tls on needs --tls-cert-file or a data dir")?;
            let (id, made) = felix_quic::tls::ensure_server_cert(&dir, "controlplane")
                .map_err(|e| e.to_string())?;
            if made {
                tracing::info!(ca = %id.ca.display(), "made a development TLS certificate for the control plane; clients trust the CA file");
            }
            (id.cert.cert, id.cert.key)
        }
    };
    let server = server_config(&cert, &key)?;
    // Fail at start, not at the first call to another member.
    client_builder(cfg.member_ca().as_deref())?
        .build()
        .map_err(|e| format!("TLS client: {e}"))?;
    Ok(Some(server))
}

/// An HTTP client for calls to other members (or to the leader): it trusts `ca` (PEM, one
/// or more certificates) on top of the system's roots.
pub fn client_builder(ca: Option<&Path>) -> Result<reqwest::ClientBuilder, String> {
    crate::ca_bundle::trust(reqwest::Client::builder(), ca).map_err(|e| format!("TLS CA {e}"))
}

/// Bounds of the handshake stage.
#[derive(Debug, Clone, Copy)]
pub struct HandshakeLimits {
    /// A connection whose handshake has not finished by then is closed.
    pub timeout: Duration,
    /// Handshakes in progress at once; past it, `accept` waits.
    pub in_flight_max: usize,
}

/// The REST listener with TLS: completed handshakes come out of `accept`.
pub struct TlsListener {
    rx: mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    acceptor: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(
        tcp: TcpListener,
        cfg: Arc<rustls::ServerConfig>,
        limits: HandshakeLimits,
    ) -> std::io::Result<TlsListener> {
        assert!(limits.in_flight_max > 0, "in_flight_max must be above 0");
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(limits.in_flight_max);
        let acceptor = tokio::spawn(accept_loop(
            tcp,
            tokio_rustls::TlsAcceptor::from(cfg),
            tx,
            limits,
        ));
        Ok(TlsListener {
            rx,
            local,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // Stop taking connections with the server; handshakes in progress end on their own
        // (their sends fail once the receiver is gone).
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept loop only ends when this listener is dropped (abort) or the TCP
            // listener fails for good, which it does not (errors are retried): wait for
            // the server's shutdown rather than spin.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    tx: mpsc::Sender<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    limits: HandshakeLimits,
) {
    let slots = Arc::new(Semaphore::new(limits.in_flight_max));
    let mut last_warn: Option<tokio::time::Instant> = None;
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (sock, peer) = match tcp.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning, and say so
                // (once a minute at most).
                if last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!("REST listener: accept failed: {e}");
                    last_warn = Some(tokio::time::Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        tokio::spawn(async move {
            let _slot = slot;
            match tokio::time::timeout(limits.timeout, acceptor.accept(sock)).await {
                Ok(Ok(s)) => {
                    let _ = tx.send((s, peer)).await;
                }
                Ok(Err(e)) => {
                    HANDSHAKE_FAILURES.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, "TLS handshake failed: {e}");
                }
                Err(_) => {
                    HANDSHAKE_FAILURES.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, "TLS handshake timed out");
                }
            }
        });
    }
}

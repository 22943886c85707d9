//! TLS 1.3 contexts on BoringSSL for quiche, and the self-signed development certificate.

use boring::asn1::Asn1Time;
use boring::bn::{BigNum, MsbOption};
use boring::ec::{EcGroup, EcKey};
use boring::hash::MessageDigest;
use boring::nid::Nid;
use boring::pkey::PKey;
use boring::ssl::{SslContextBuilder, SslFiletype, SslMethod, SslVerifyMode, SslVersion};
use boring::x509::extension::{
    BasicConstraints, ExtendedKeyUsage, KeyUsage, SubjectAlternativeName,
};
use boring::x509::{X509NameBuilder, X509};
use std::path::{Path, PathBuf};

/// ALPN of Felix protocol v1.
pub const ALPN: &[u8] = b"felix/1";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS: {0}")]
    Boring(#[from] boring::error::ErrorStack),
    #[error("TLS file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("quiche config: {0}")]
    Quiche(#[from] quiche::Error),
    #[error("transport: {0}")]
    Transport(String),
}

/// Paths of a certificate chain and its private key (PEM).
#[derive(Debug, Clone)]
pub struct CertPaths {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Make sure a development certificate exists under `dir` (`dev-cert.pem`, `dev-key.pem`),
/// generating a self-signed EC P-256 pair valid for `localhost` and `127.0.0.1` on first use.
/// The certificate is its own CA: clients verify against `dev-cert.pem`.
pub fn ensure_dev_cert(dir: &Path) -> Result<(CertPaths, bool), TlsError> {
    let paths = CertPaths {
        cert: dir.join("dev-cert.pem"),
        key: dir.join("dev-key.pem"),
    };
    if paths.cert.exists() && paths.key.exists() {
        return Ok((paths, false));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (cert_pem, key_pem) = generate_self_signed(&["localhost"], &["127.0.0.1", "::1"])?;
    write_pair(&paths, &cert_pem, &key_pem)?;
    Ok((paths, true))
}

/// Write a certificate and its key: the key first with owner-only permissions, each to a
/// temp name and renamed, so a crash never leaves a certificate without its key.
fn write_pair(paths: &CertPaths, cert_pem: &[u8], key_pem: &[u8]) -> Result<(), TlsError> {
    let tmp = |p: &Path| {
        let mut t = p.as_os_str().to_owned();
        t.push(".tmp");
        PathBuf::from(t)
    };
    let tmp_key = tmp(&paths.key);
    write_private(&tmp_key, key_pem).map_err(io(&tmp_key))?;
    std::fs::rename(&tmp_key, &paths.key).map_err(io(&paths.key))?;
    let tmp_cert = tmp(&paths.cert);
    std::fs::write(&tmp_cert, cert_pem).map_err(io(&tmp_cert))?;
    std::fs::rename(&tmp_cert, &paths.cert).map_err(io(&paths.cert))?;
    Ok(())
}

/// The error of a file operation on `path`.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError {
    let path = path.to_path_buf();
    move |source| TlsError::Io { path, source }
}

fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(data)?;
    f.sync_all()
}

/// Generate a self-signed certificate (PEM) and PKCS#8 key (PEM).
pub fn generate_self_signed(dns: &[&str], ips: &[&str]) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let (key, name, mut b) = cert_builder("felix-dev")?;
    b.set_issuer_name(&name)?;
    let bc = BasicConstraints::new().critical().ca().build()?;
    b.append_extension(&bc)?;
    let mut san = SubjectAlternativeName::new();
    for d in dns {
        san.dns(d);
    }
    for ip in ips {
        san.ip(ip);
    }
    let san = san.build(&b.x509v3_context(None, None))?;
    b.append_extension(&san)?;
    b.sign(&key, MessageDigest::sha256())?;
    let cert = b.build();
    Ok((cert.to_pem()?, key.private_key_to_pem_pkcs8()?))
}

/// The name a broker's peer certificate carries for node `id` (a DNS subject alternative
/// name): a peer link dials `node-<id>` and checks the listener's certificate names it; the
/// listener checks the dialer's certificate names the node its `PeerHello` claims.
pub fn node_name(id: u64) -> String {
    format!("node-{id}")
}

/// The files of a broker's peer identity: its certificate and key, and the cluster's CA
/// (every broker of a cluster trusts one CA; certificates each broker signs for itself could
/// not verify each other).
#[derive(Debug, Clone)]
pub struct PeerTls {
    pub cert: CertPaths,
    pub ca: PathBuf,
}

/// Generate a cluster CA and one certificate per node, signed by it, under `dir`:
/// `ca.pem` (and `ca-key.pem`, 0600), `node-<id>.pem` and `node-<id>-key.pem` (0600). A node's
/// certificate names `node-<id>`, `localhost` and the loopback addresses, for client and
/// server use. An existing CA is reused (adding a node to a cluster); node files are rewritten.
pub fn generate_cluster_certs(dir: &Path, nodes: &[u64]) -> Result<Vec<PeerTls>, TlsError> {
    let (ca_path, ca, ca_key) = ensure_ca(dir)?;
    let mut out = Vec::new();
    for &id in nodes {
        let name = node_name(id);
        let (cert_pem, key_pem) = issue_node_cert(&ca, &ca_key, &name)?;
        let cert = dir.join(format!("{name}.pem"));
        let key = dir.join(format!("{name}-key.pem"));
        write_private(&key, &key_pem).map_err(io(&key))?;
        std::fs::write(&cert, &cert_pem).map_err(io(&cert))?;
        out.push(PeerTls {
            cert: CertPaths { cert, key },
            ca: ca_path.clone(),
        });
    }
    Ok(out)
}

/// The CA under `dir` (`ca.pem`, and `ca-key.pem` 0600), made on first use and reused after.
fn ensure_ca(dir: &Path) -> Result<(PathBuf, X509, PKey<boring::pkey::Private>), TlsError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (ca_path, ca_key_path) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
    if ca_path.exists() && ca_key_path.exists() {
        let c = std::fs::read(&ca_path).map_err(io(&ca_path))?;
        let k = std::fs::read(&ca_key_path).map_err(io(&ca_key_path))?;
        return Ok((
            ca_path,
            X509::from_pem(&c)?,
            PKey::private_key_from_pem(&k)?,
        ));
    }
    let (c, k) = generate_self_signed(&[], &[])?;
    // Key first and the certificate last: a crash between them leaves no CA to reuse (the
    // next start makes a new one) rather than a CA without its key.
    write_private(&ca_key_path, &k).map_err(io(&ca_key_path))?;
    std::fs::write(&ca_path, &c).map_err(io(&ca_path))?;
    Ok((
        ca_path,
        X509::from_pem(&c)?,
        PKey::private_key_from_pem(&k)?,
    ))
}

/// A development server identity under `dir` for `name` (the control plane's HTTPS): the CA
/// of [`generate_cluster_certs`] (made on first use) and `<name>.pem` / `<name>-key.pem`
/// signed by it, for `name`, `localhost` and the loopback addresses. Clients trust `ca.pem`.
/// Unlike the broker's self-signed dev certificate, the leaf is not a CA: rustls (the HTTPS
/// side) refuses a CA certificate used as a server's own. Existing files are kept, so a
/// restart serves the same certificate; the `bool` says whether it was made now.
pub fn ensure_server_cert(dir: &Path, name: &str) -> Result<(PeerTls, bool), TlsError> {
    let (ca_path, ca, ca_key) = ensure_ca(dir)?;
    let paths = CertPaths {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}-key.pem")),
    };
    let made = !(paths.cert.exists() && paths.key.exists());
    if made {
        let (cert_pem, key_pem) = issue_node_cert(&ca, &ca_key, name)?;
        write_pair(&paths, &cert_pem, &key_pem)?;
    }
    Ok((
        PeerTls {
            cert: paths,
            ca: ca_path,
        },
        made,
    ))
}

/// A fresh EC P-256 key, the subject `CN=common_name`, and a v3 certificate builder with a
/// random serial, that subject and key, valid from now for ten years.
fn cert_builder(
    common_name: &str,
) -> Result<
    (
        PKey<boring::pkey::Private>,
        boring::x509::X509Name,
        boring::x509::X509Builder,
    ),
    TlsError,
> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
    let key = PKey::from_ec_key(EcKey::generate(&group)?)?;
    let mut subject = X509NameBuilder::new()?;
    subject.append_entry_by_nid(Nid::COMMONNAME, common_name)?;
    let subject = subject.build();
    let mut b = X509::builder()?;
    b.set_version(2)?;
    let mut serial = BigNum::new()?;
    serial.rand(127, MsbOption::MAYBE_ZERO, false)?;
    let serial = serial.to_asn1_integer()?;
    b.set_serial_number(&serial)?;
    b.set_subject_name(&subject)?;
    b.set_pubkey(&key)?;
    let (nb, na) = (Asn1Time::days_from_now(0)?, Asn1Time::days_from_now(3650)?);
    b.set_not_before(&nb)?;
    b.set_not_after(&na)?;
    Ok((key, subject, b))
}

/// A leaf certificate for `name` signed by the CA (PEM cert, PKCS#8 PEM key).
fn issue_node_cert(
    ca: &X509,
    ca_key: &PKey<boring::pkey::Private>,
    name: &str,
) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let (key, _, mut b) = cert_builder(name)?;
    b.set_issuer_name(ca.subject_name())?;
    let bc = BasicConstraints::new().build()?;
    b.append_extension(&bc)?;
    let ku = KeyUsage::new().digital_signature().build()?;
    b.append_extension(&ku)?;
    let eku = ExtendedKeyUsage::new()
        .server_auth()
        .client_auth()
        .build()?;
    b.append_extension(&eku)?;
    let san = SubjectAlternativeName::new()
        .dns(name)
        .dns("localhost")
        .ip("127.0.0.1")
        .ip("::1")
        .build(&b.x509v3_context(Some(ca), None))?;
    b.append_extension(&san)?;
    b.sign(ca_key, MessageDigest::sha256())?;
    Ok((b.build().to_pem()?, key.private_key_to_pem_pkcs8()?))
}

/// The DNS names a DER certificate carries (its subject alternative names).
pub fn cert_dns_names(der: &[u8]) -> Vec<String> {
    let Ok(x) = X509::from_der(der) else {
        return Vec::new();
    };
    x.subject_alt_names()
        .map(|names| {
            names
                .iter()
                .filter_map(|n| n.dnsname().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The DNS names the first certificate of a PEM file carries.
pub fn pem_dns_names(pem: &[u8]) -> Vec<String> {
    match X509::from_pem(pem).and_then(|x| x.to_der()) {
        Ok(der) => cert_dns_names(&der),
        Err(_) => Vec::new(),
    }
}

fn peer_builder(tls: &PeerTls) -> Result<SslContextBuilder, TlsError> {
    let mut b = tls13_builder()?;
    b.set_certificate_chain_file(&tls.cert.cert)?;
    b.set_private_key_file(&tls.cert.key, SslFiletype::PEM)?;
    b.check_private_key()?;
    b.set_ca_file(&tls.ca)?;
    Ok(b)
}

/// A peer link's connection window holds every lane's stream window
/// ([`crate::wire::peer::lanes::COUNT`]): otherwise an owner that stopped reading forwarded
/// publishes could leave the replication lane without connection credit.
pub fn peer_windows_check(t: &TransportConfig) -> Result<(), TlsError> {
    let lanes = crate::wire::peer::lanes::COUNT;
    if t.max_data_bytes < lanes * t.max_stream_data_bidi_bytes {
        return Err(TlsError::Transport(format!(
            "a peer link's connection window ({} bytes) must hold its {lanes} lanes' stream windows ({} bytes each), so a stalled lane cannot starve the others",
            t.max_data_bytes, t.max_stream_data_bidi_bytes
        )));
    }
    Ok(())
}

/// quiche config of a broker's peer listener: its node certificate, and a client certificate
/// required from every dialer, verified against the cluster CA. Which node the certificate
/// names is checked against the dialer's `PeerHello` ([`cert_dns_names`]).
pub fn peer_server_config(tls: &PeerTls, t: &TransportConfig) -> Result<quiche::Config, TlsError> {
    peer_windows_check(t)?;
    let mut b = peer_builder(tls)?;
    b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    let mut c = quiche::Config::with_boring_ssl_ctx_builder(quiche::PROTOCOL_VERSION, b)?;
    apply_transport(&mut c, t)?;
    Ok(c)
}

/// quiche config of a broker dialing a peer: presents its node certificate and verifies the
/// listener's against the cluster CA and the name `node-<id>` it dials
/// (`quiche::connect(Some(&node_name(id)), ..)`).
pub fn peer_client_config(tls: &PeerTls, t: &TransportConfig) -> Result<quiche::Config, TlsError> {
    peer_windows_check(t)?;
    let b = peer_builder(tls)?;
    let mut c = quiche::Config::with_boring_ssl_ctx_builder(quiche::PROTOCOL_VERSION, b)?;
    c.verify_peer(true);
    apply_transport(&mut c, t)?;
    Ok(c)
}

/// Transport settings shared by both ends.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    pub idle_timeout_ms: u64,
    pub max_data_bytes: u64,
    pub max_stream_data_bidi_bytes: u64,
    /// Per unidirectional stream window this end grants (subscriptions on the client).
    pub max_stream_data_uni_bytes: u64,
    pub max_streams_bidi: u64,
    pub max_streams_uni: u64,
    /// quiche congestion control: `cubic` (default), `reno`, `bbr2`. Cubic, because with a
    /// broker that answers from an event loop BBR2 sizes its window from loopback's ~20 µs
    /// minimum RTT and under-fills the path: measured here 1 KiB fanout-1 throughput
    /// 270-300 MB/s with subscriber queue overflow under BBR2 vs 336-365 MB/s lossless
    /// under cubic (bench-results/2026-12-03-gso-gro.md).
    pub cc_algorithm: String,
    /// Ceiling of the UDP payloads this end sends and accepts, bytes
    /// ([`crate::UDP_PAYLOAD_MIN`]..=[`crate::UDP_PAYLOAD_SLOT`]; clamped). Above the minimum,
    /// path MTU discovery probes up to it, and packets grow only once a probe of that size
    /// has been acknowledged, so a path that drops large datagrams costs probes, not data.
    pub udp_payload_max_bytes: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            idle_timeout_ms: 30_000,
            max_data_bytes: 64 * 1024 * 1024,
            max_stream_data_bidi_bytes: 16 * 1024 * 1024,
            max_stream_data_uni_bytes: 16 * 1024 * 1024,
            max_streams_bidi: 1024,
            max_streams_uni: 1024,
            cc_algorithm: "cubic".into(),
            udp_payload_max_bytes: crate::DEFAULT_UDP_PAYLOAD_MAX,
        }
    }
}

fn apply_transport(c: &mut quiche::Config, t: &TransportConfig) -> Result<(), TlsError> {
    c.set_application_protos(&[ALPN])?;
    c.set_max_idle_timeout(t.idle_timeout_ms);
    let udp_max = t
        .udp_payload_max_bytes
        .clamp(crate::UDP_PAYLOAD_MIN, crate::UDP_PAYLOAD_SLOT);
    c.set_max_recv_udp_payload_size(udp_max);
    c.set_max_send_udp_payload_size(udp_max);
    // Probing needs the sockets to refuse fragmentation (udp::set_pmtu_probe), or an
    // oversized probe would arrive as fragments and "succeed".
    c.discover_pmtu(udp_max > crate::UDP_PAYLOAD_MIN);
    c.set_initial_max_data(t.max_data_bytes);
    c.set_initial_max_stream_data_bidi_local(t.max_stream_data_bidi_bytes);
    c.set_initial_max_stream_data_bidi_remote(t.max_stream_data_bidi_bytes);
    c.set_initial_max_stream_data_uni(t.max_stream_data_uni_bytes);
    c.set_initial_max_streams_bidi(t.max_streams_bidi);
    c.set_initial_max_streams_uni(t.max_streams_uni);
    c.set_max_connection_window(t.max_data_bytes);
    c.set_max_stream_window(
        t.max_stream_data_bidi_bytes
            .max(t.max_stream_data_uni_bytes),
    );
    c.set_disable_active_migration(true);
    c.set_cc_algorithm_name(&t.cc_algorithm)?;
    Ok(())
}

fn tls13_builder() -> Result<SslContextBuilder, TlsError> {
    let mut b = SslContextBuilder::new(SslMethod::tls())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
    Ok(b)
}

/// quiche config for the broker: certificate chain and key from PEM files, TLS 1.3 only.
pub fn server_config(cert: &CertPaths, t: &TransportConfig) -> Result<quiche::Config, TlsError> {
    let mut b = tls13_builder()?;
    b.set_certificate_chain_file(&cert.cert)?;
    b.set_private_key_file(&cert.key, SslFiletype::PEM)?;
    b.check_private_key()?;
    let mut c = quiche::Config::with_boring_ssl_ctx_builder(quiche::PROTOCOL_VERSION, b)?;
    c.verify_peer(false);
    apply_transport(&mut c, t)?;
    Ok(c)
}

/// How a client checks the broker's certificate.
#[derive(Debug, Clone)]
pub enum Verify {
    /// Verify the chain against this CA file (PEM) and the server name.
    CaFile(PathBuf),
    /// Verify against the system trust store.
    System,
    /// No verification at all. Development only: anyone on the path can impersonate the broker.
    Insecure,
}

/// quiche config for a client.
pub fn client_config(verify: &Verify, t: &TransportConfig) -> Result<quiche::Config, TlsError> {
    let mut b = tls13_builder()?;
    match verify {
        Verify::CaFile(p) => b.set_ca_file(p)?,
        Verify::System => b.set_default_verify_paths()?,
        Verify::Insecure => {}
    }
    let mut c = quiche::Config::with_boring_ssl_ctx_builder(quiche::PROTOCOL_VERSION, b)?;
    c.verify_peer(!matches!(verify, Verify::Insecure));
    apply_transport(&mut c, t)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_cert_is_generated_once_and_loads() {
        let dir = tempfile::tempdir().unwrap();
        let (p, created) = ensure_dev_cert(dir.path()).unwrap();
        assert!(created);
        let first = std::fs::read(&p.cert).unwrap();
        let (p2, created2) = ensure_dev_cert(dir.path()).unwrap();
        assert!(!created2, "kept in the data dir, not regenerated");
        assert_eq!(std::fs::read(&p2.cert).unwrap(), first);
        server_config(&p, &TransportConfig::default()).unwrap();
        client_config(&Verify::CaFile(p.cert.clone()), &TransportConfig::default()).unwrap();
        let x = X509::from_pem(&first).unwrap();
        assert!(x
            .subject_alt_names()
            .unwrap()
            .iter()
            .any(|n| n.dnsname() == Some("localhost")));
    }

    /// Runs a handshake between a dialer built from `cc` asking for `name` and a listener
    /// built from `sc`, over memory; returns both ends once nothing moves any more.
    fn handshake(
        cc: &mut quiche::Config,
        sc: &mut quiche::Config,
        name: &str,
    ) -> (quiche::Connection, quiche::Connection) {
        let (ca, sa): (std::net::SocketAddr, std::net::SocketAddr) = (
            "127.0.0.1:1000".parse().unwrap(),
            "127.0.0.1:2000".parse().unwrap(),
        );
        let cid = quiche::ConnectionId::from_ref(&[7; 16]);
        let scid = quiche::ConnectionId::from_ref(&[9; 16]);
        let mut c = quiche::connect(Some(name), &cid, ca, sa, cc).unwrap();
        let mut s = quiche::accept(&scid, None, sa, ca, sc).unwrap();
        for _ in 0..50 {
            let a = deliver(&mut c, &mut s, (ca, sa), usize::MAX);
            let b = deliver(&mut s, &mut c, (sa, ca), usize::MAX);
            if a.is_empty() && b.is_empty() {
                break;
            }
        }
        (c, s)
    }

    /// Peer links: two nodes of one cluster CA verify each other, the listener sees which
    /// node dialed, a dialer asking for another node's name fails, and a dialer without a
    /// certificate (or with one from another CA) is refused.
    #[test]
    fn peer_certificates_bind_the_node_id() {
        let dir = tempfile::tempdir().unwrap();
        let t = TransportConfig::default();
        let nodes = generate_cluster_certs(dir.path(), &[1, 2]).unwrap();
        let (n1, n2) = (&nodes[0], &nodes[1]);
        let mut cc = peer_client_config(n1, &t).unwrap();
        let mut sc = peer_server_config(n2, &t).unwrap();
        let (c, s) = handshake(&mut cc, &mut sc, &node_name(2));
        assert!(c.is_established() && s.is_established());
        let seen = cert_dns_names(s.peer_cert().expect("client certificate"));
        assert!(seen.contains(&node_name(1)), "{seen:?}");
        assert!(!seen.contains(&node_name(2)));

        // Dialing node 3 at node 2's address: node 2's certificate does not name node-3.
        let mut cc = peer_client_config(n1, &t).unwrap();
        let mut sc = peer_server_config(n2, &t).unwrap();
        let (c, _) = handshake(&mut cc, &mut sc, &node_name(3));
        assert!(!c.is_established());

        // No client certificate at all.
        let mut plain = client_config(&Verify::CaFile(n1.ca.clone()), &t).unwrap();
        let mut sc = peer_server_config(n2, &t).unwrap();
        let (c, s) = handshake(&mut plain, &mut sc, &node_name(2));
        assert!(!s.is_established() || !c.is_established() || s.peer_cert().is_none());
        assert!(
            !s.is_established(),
            "a listener requires a client certificate"
        );

        // Another cluster's CA: neither side verifies.
        let other = tempfile::tempdir().unwrap();
        let foreign = generate_cluster_certs(other.path(), &[1]).unwrap();
        let mut cc = peer_client_config(&foreign[0], &t).unwrap();
        let mut sc = peer_server_config(n2, &t).unwrap();
        let (c, s) = handshake(&mut cc, &mut sc, &node_name(2));
        assert!(!(c.is_established() && s.is_established()));

        // The CA is reused when a node is added.
        let ca_before = std::fs::read(&n1.ca).unwrap();
        generate_cluster_certs(dir.path(), &[3]).unwrap();
        assert_eq!(std::fs::read(&n1.ca).unwrap(), ca_before);
    }

    /// Moves every packet `from` has to send into `to`, dropping those larger than
    /// `path_mtu` (a path that silently discards big datagrams); returns the sizes sent.
    fn deliver(
        from: &mut quiche::Connection,
        to: &mut quiche::Connection,
        addrs: (std::net::SocketAddr, std::net::SocketAddr),
        path_mtu: usize,
    ) -> Vec<usize> {
        let mut buf = vec![0u8; crate::UDP_PAYLOAD_SLOT];
        let mut sizes = Vec::new();
        loop {
            match from.send(&mut buf) {
                Ok((n, _)) => {
                    sizes.push(n);
                    if n <= path_mtu {
                        let info = quiche::RecvInfo {
                            from: addrs.0,
                            to: addrs.1,
                        };
                        let _ = to.recv(&mut buf[..n], info);
                    }
                }
                Err(quiche::Error::Done) => return sizes,
                Err(e) => panic!("send: {e}"),
            }
        }
    }

    /// Client and server built from Felix's configs over an in-memory path of `path_mtu`;
    /// the client sends `total` bytes on one stream, at most `chunk` per round trip (a
    /// sender that leaves congestion-window room, which quiche needs before it probes). Returns the sizes of the client's
    /// packets and the path MTU it settled on, after checking every byte arrived.
    fn transfer(
        t: &TransportConfig,
        path_mtu: usize,
        total: usize,
        chunk: usize,
    ) -> (Vec<usize>, usize) {
        let dir = tempfile::tempdir().unwrap();
        let (p, _) = ensure_dev_cert(dir.path()).unwrap();
        let mut sc = server_config(&p, t).unwrap();
        let mut cc = client_config(&Verify::CaFile(p.cert.clone()), t).unwrap();
        let (ca, sa): (std::net::SocketAddr, std::net::SocketAddr) = (
            "127.0.0.1:1000".parse().unwrap(),
            "127.0.0.1:2000".parse().unwrap(),
        );
        let cid = quiche::ConnectionId::from_ref(&[7; 16]);
        let scid = quiche::ConnectionId::from_ref(&[9; 16]);
        let mut c = quiche::connect(Some("localhost"), &cid, ca, sa, &mut cc).unwrap();
        let mut s = quiche::accept(&scid, None, sa, ca, &mut sc).unwrap();
        let data = vec![0x5a; total];
        let (mut written, mut read) = (0, 0);
        let mut sizes = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        // Bounded in rounds and time; a round without progress fires the timers.
        for _ in 0..200_000 {
            if read == total || std::time::Instant::now() > deadline {
                break;
            }
            if c.is_established() && written < total {
                let end = total.min(written.saturating_add(chunk));
                written += c.stream_send(0, &data[written..end], false).unwrap_or(0);
            }
            let out = deliver(&mut c, &mut s, (ca, sa), path_mtu);
            let back = deliver(&mut s, &mut c, (sa, ca), path_mtu);
            sizes.extend(out.iter().copied());
            while let Ok((n, _)) = s.stream_recv(0, &mut buf) {
                assert!(buf[..n].iter().all(|&b| b == 0x5a));
                read += n;
            }
            if out.is_empty() && back.is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(1));
                c.on_timeout();
                s.on_timeout();
            }
        }
        assert_eq!(read, total, "every byte arrived");
        assert!(!c.is_closed() && !s.is_closed());
        let pmtu = c.path_stats().next().unwrap().pmtu;
        (sizes, pmtu)
    }

    /// Path MTU discovery: on a path that carries everything, packets grow to the configured
    /// ceiling; on one that drops datagrams over 1,400 bytes, discovery settles at or below
    /// that and the transfer still completes; a ceiling of 1,350 is never exceeded.
    #[test]
    fn packets_grow_to_what_the_path_carries() {
        let t = TransportConfig::default();
        let (sizes, pmtu) = transfer(&t, usize::MAX, 4 << 20, usize::MAX);
        assert_eq!(pmtu, crate::DEFAULT_UDP_PAYLOAD_MAX);
        assert_eq!(sizes.iter().max(), Some(&crate::DEFAULT_UDP_PAYLOAD_MAX));
        let big: usize = sizes.iter().filter(|&&n| n > 8_000).sum();
        let all: usize = sizes.iter().sum();
        assert!(
            big * 10 > all * 8,
            "most bytes travel in large packets: {big} of {all}"
        );

        // Datagrams over 1,400 bytes vanish: only the probes are lost, a bounded handful, and
        // the search ends within a few bytes of the real limit.
        let (sizes, pmtu) = transfer(&t, 1400, 2 << 20, 32 << 10);
        assert!((1300..=1400).contains(&pmtu), "settled at {pmtu}");
        let lost = sizes.iter().filter(|&&n| n > 1400).count();
        assert!(lost <= 64, "{lost} probes lost");

        let small = TransportConfig {
            udp_payload_max_bytes: 1350,
            ..TransportConfig::default()
        };
        let (sizes, pmtu) = transfer(&small, usize::MAX, 1 << 20, usize::MAX);
        assert!(pmtu <= 1350 && sizes.iter().all(|&n| n <= 1350));
    }
}

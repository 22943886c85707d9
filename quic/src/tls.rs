//! TLS 1.3 contexts on BoringSSL for quiche, and the self-signed development certificate.

use boring::asn1::Asn1Time;
use boring::bn::{BigNum, MsbOption};
use boring::ec::{EcGroup, EcKey};
use boring::hash::MessageDigest;
use boring::nid::Nid;
use boring::pkey::PKey;
use boring::ssl::{SslContextBuilder, SslFiletype, SslMethod, SslVersion};
use boring::x509::extension::{BasicConstraints, SubjectAlternativeName};
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
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TlsError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (cert_pem, key_pem) = generate_self_signed(&["localhost"], &["127.0.0.1", "::1"])?;
    // Key first with owner-only permissions, written to a temp name and renamed, so a crash
    // never leaves a certificate without its key.
    let tmp_key = dir.join("dev-key.pem.tmp");
    write_private(&tmp_key, &key_pem).map_err(io(&tmp_key))?;
    std::fs::rename(&tmp_key, &paths.key).map_err(io(&paths.key))?;
    let tmp_cert = dir.join("dev-cert.pem.tmp");
    std::fs::write(&tmp_cert, &cert_pem).map_err(io(&tmp_cert))?;
    std::fs::rename(&tmp_cert, &paths.cert).map_err(io(&paths.cert))?;
    Ok((paths, true))
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
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
    let key = PKey::from_ec_key(EcKey::generate(&group)?)?;
    let mut name = X509NameBuilder::new()?;
    name.append_entry_by_nid(Nid::COMMONNAME, "felix-dev")?;
    let name = name.build();
    let mut b = X509::builder()?;
    b.set_version(2)?;
    let mut serial = BigNum::new()?;
    serial.rand(127, MsbOption::MAYBE_ZERO, false)?;
    let serial = serial.to_asn1_integer()?;
    b.set_serial_number(&serial)?;
    b.set_subject_name(&name)?;
    b.set_issuer_name(&name)?;
    b.set_pubkey(&key)?;
    let nb = Asn1Time::days_from_now(0)?;
    b.set_not_before(&nb)?;
    let na = Asn1Time::days_from_now(3650)?;
    b.set_not_after(&na)?;
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
        }
    }
}

fn apply_transport(c: &mut quiche::Config, t: &TransportConfig) -> Result<(), TlsError> {
    c.set_application_protos(&[ALPN])?;
    c.set_max_idle_timeout(t.idle_timeout_ms);
    c.set_max_recv_udp_payload_size(crate::MAX_UDP_PAYLOAD);
    c.set_max_send_udp_payload_size(crate::MAX_UDP_PAYLOAD);
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
}

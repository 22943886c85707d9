//! The one reader of a PEM CA bundle for the clients of the control plane (felixctl, the
//! brokers, the members calling each other). A file that reads but holds no certificate is an
//! error here: an empty trust set would fail every handshake later, far from its cause.

use std::path::Path;

/// The certificates of the PEM bundle at `path`: at least one, or why not (the caller names
/// the setting the path came from).
pub fn load(path: &Path) -> Result<Vec<reqwest::Certificate>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

/// `b` trusting the bundle at `ca` as well (no `ca`: `b` as it was).
pub fn trust(
    mut b: reqwest::ClientBuilder,
    ca: Option<&Path>,
) -> Result<reqwest::ClientBuilder, String> {
    if let Some(p) = ca {
        for c in load(p)? {
            b = b.add_root_certificate(c);
        }
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_an_empty_and_a_garbled_bundle_are_each_refused() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("nope.pem");
        assert!(load(&missing).unwrap_err().contains("nope.pem"));
        let empty = d.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        assert!(load(&empty).unwrap_err().contains("no PEM certificate"));
        let garbled = d.path().join("garbled.pem");
        std::fs::write(
            &garbled,
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        assert!(load(&garbled).is_err());
    }
}

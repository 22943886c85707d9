//! Who may speak, set up at start (the driver side of `felix_control::auth`): the verifier the
//! cores check tokens with, from this broker's own key (`auth = standalone`) or a key set
//! file (`auth = jwks`), and `felix-broker token create`, which signs tokens with the
//! standalone key.
//!
//! With a control plane (`auth = controlplane`, what `auto` picks there) the key set comes
//! from the control plane: the control link fetches it with the node credential before the
//! broker reports ready, again every `auth_jwks_refresh_ms`, and at once when a token names
//! a key this broker does not know ([`AuthKeys`]).
//!
//! A standalone broker keeps its signing key in `DATA_DIR/auth/signing-key.json` (mode 0600,
//! made at the first start) and writes a fresh admin token to `DATA_DIR/auth/admin.token`
//! (mode 0600) at every start, valid `auth_admin_token_ttl_s`.

use crate::config::Config;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use felix_control::auth::{
    admin_claims, AuthError, Claims, Jwks, Permission, Principal, RevocationFeed, RevocationSet,
    SigningKey, Verifier, ISSUER,
};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::RwLock;

pub mod local_revocations;

/// The file a standalone broker's key lives in, under the data dir.
pub fn key_path(data_dir: &Path) -> PathBuf {
    data_dir.join("auth").join("signing-key.json")
}

/// The admin token a standalone broker writes at each start, under the data dir.
pub fn admin_token_path(data_dir: &Path) -> PathBuf {
    data_dir.join("auth").join("admin.token")
}

#[derive(Serialize, Deserialize)]
struct KeyFile {
    kid: String,
    /// The Ed25519 seed, base64url.
    seed: String,
}

/// Write `bytes` to `path` (mode 0600) atomically and durably.
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |e: std::io::Error| format!("{}: {e}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    // Written beside and renamed, so a reader never sees half a key or token.
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    // The rename itself survives a machine crash only once the directory is synced.
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io),
        None => Ok(()),
    }
}

fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    rand::thread_rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The standalone key under `data_dir`, made on first use.
pub fn standalone_key(data_dir: &Path) -> Result<SigningKey, String> {
    let path = key_path(data_dir);
    match std::fs::read(&path) {
        Ok(raw) => {
            let k: KeyFile = serde_json::from_slice(&raw)
                .map_err(|e| format!("{}: not a signing key file: {e}", path.display()))?;
            let seed: [u8; 32] = URL_SAFE_NO_PAD
                .decode(&k.seed)
                .ok()
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| {
                    format!("{}: the seed is not 32 bytes of base64url", path.display())
                })?;
            Ok(SigningKey::from_seed(&k.kid, seed))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut seed = [0u8; 32];
            rand::thread_rng().fill_bytes(&mut seed);
            let kid = format!("standalone-{}", random_hex(4));
            let file = KeyFile {
                kid: kid.clone(),
                seed: URL_SAFE_NO_PAD.encode(seed),
            };
            write_private(&path, &serde_json::to_vec(&file).expect("serializable"))?;
            tracing::info!(path = %path.display(), %kid, "generated the standalone signing key");
            Ok(SigningKey::from_seed(&kid, seed))
        }
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

pub(crate) fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The keys the cores verify tokens with, shared by every core and replaced whole when the
/// key set changes (a rotation on the control plane).
pub struct AuthKeys {
    verifier: RwLock<Arc<Verifier>>,
    /// A key set was loaded (a control-plane broker is not ready before).
    loaded: AtomicBool,
    /// A token named an unknown key: the control link fetches the key set now.
    refetch: AtomicBool,
    /// The revocations the control plane's feed last answered (empty standalone).
    revoked: RwLock<Arc<RevocationSet>>,
    /// The feed's revision held; the cores re-check their connections when it moves.
    revocation_revision: AtomicU64,
    /// Unix ms of the feed's last answer (0: never; standalone brokers have no feed).
    revocations_synced_ms: AtomicU64,
    /// Polls of the feed that failed.
    revocation_feed_failures: AtomicU64,
    /// Unix ms since when the feed has not answered (0 while it answers).
    revocation_feed_lost_ms: AtomicU64,
}

impl AuthKeys {
    pub fn new(jwks: &Jwks) -> Result<AuthKeys, String> {
        Ok(AuthKeys {
            verifier: RwLock::new(Arc::new(Verifier::new(jwks)?)),
            loaded: AtomicBool::new(!jwks.keys.is_empty()),
            refetch: AtomicBool::new(false),
            revoked: RwLock::new(Arc::new(RevocationSet::default())),
            revocation_revision: AtomicU64::new(0),
            revocations_synced_ms: AtomicU64::new(0),
            revocation_feed_failures: AtomicU64::new(0),
            revocation_feed_lost_ms: AtomicU64::new(0),
        })
    }

    /// Verify `token` at `now_s`. An unknown key asks for a fetch of the key set, so a token
    /// signed by a key the control plane just added verifies on a retry moments later.
    pub fn verify(&self, token: &str, now_s: u64) -> Result<Principal, AuthError> {
        let v = self
            .verifier
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let r = v.verify(token, now_s);
        if matches!(r, Err(AuthError::UnknownKey(_))) {
            self.refetch.store(true, Ordering::Release);
        }
        let p = r?;
        match self.revoked(&p) {
            Some(why) => Err(AuthError::Revoked(why)),
            None => Ok(p),
        }
    }

    /// Why `p` is revoked, by the revocations held, if it is.
    pub fn revoked(&self, p: &Principal) -> Option<String> {
        self.revoked
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .revoked(p)
    }

    /// Install what the revocation feed answered (the whole list replaces the one held).
    pub fn set_revocations(&self, feed: &RevocationFeed, now_ms: u64) {
        let set = Arc::new(RevocationSet::new(&feed.revocations));
        *self.revoked.write().unwrap_or_else(|e| e.into_inner()) = set;
        // Stored after the set, so a core that sees the new revision checks the new set.
        self.revocation_revision
            .store(feed.revision, Ordering::Release);
        self.revocations_synced_ms
            .store(now_ms.max(1), Ordering::Release);
        self.revocation_feed_lost_ms.store(0, Ordering::Release);
    }

    /// The revision of the revocations held (the feed's; 0 before any).
    pub fn revocation_revision(&self) -> u64 {
        self.revocation_revision.load(Ordering::Acquire)
    }

    /// A poll of the feed failed (the revocations held stay in force, and tokens that verify
    /// are accepted: fail open). The outage counts from the first failure.
    pub fn revocation_feed_failed(&self, now_ms: u64) {
        self.revocation_feed_failures
            .fetch_add(1, Ordering::Relaxed);
        let _ = self.revocation_feed_lost_ms.compare_exchange(
            0,
            now_ms.max(1),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// For `/readyz`: how long the feed has not answered, if it has not.
    pub fn revocation_feed_lost(&self, now_ms: u64) -> Option<String> {
        let since = self.revocation_feed_lost_ms.load(Ordering::Acquire);
        (since != 0).then(|| {
            format!(
                "revocation feed unreachable for {} s: revocations held stay in force and verified tokens are accepted (fail open)",
                now_ms.saturating_sub(since) / 1000
            )
        })
    }

    /// Unix ms of the feed's last answer, 0 if none.
    pub fn revocations_synced_ms(&self) -> u64 {
        self.revocations_synced_ms.load(Ordering::Acquire)
    }

    /// The auth gauges and counters, as Prometheus text.
    pub fn render(&self, out: &mut String) {
        let held = self.revoked.read().unwrap_or_else(|e| e.into_inner()).len();
        for (name, kind, help, v) in [
            (
                "felix_auth_revocations",
                "gauge",
                "revocations this broker holds (tokens, subjects, tenants)",
                held as u64,
            ),
            (
                "felix_auth_revocation_feed_last_success_seconds",
                "gauge",
                "Unix time of the revocation feed's last answer, or the revocation file's last read without a control plane (0: never)",
                self.revocations_synced_ms() / 1000,
            ),
            (
                "felix_auth_revocation_feed_failures_total",
                "counter",
                "polls of the revocation feed that failed (tokens already verified stay valid: fail open)",
                self.revocation_feed_failures.load(Ordering::Relaxed),
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        }
    }

    /// Install a new key set (the old one is dropped once no verification holds it).
    pub fn replace(&self, jwks: &Jwks) -> Result<(), String> {
        let v = Arc::new(Verifier::new(jwks)?);
        *self.verifier.write().unwrap_or_else(|e| e.into_inner()) = v;
        self.loaded.store(true, Ordering::Release);
        Ok(())
    }

    pub fn loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// Whether a fetch was asked for since the last call (and clear the ask).
    pub fn take_refetch(&self) -> bool {
        self.refetch.swap(false, Ordering::AcqRel)
    }
}

impl std::fmt::Debug for AuthKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthKeys {{ loaded: {} }}", self.loaded())
    }
}

/// A credential that never shows in a log or a debug print.
#[derive(Clone)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The mode `auto` resolves to.
pub fn mode(cfg: &Config) -> &str {
    match cfg.auth.as_str() {
        "auto" if cfg.controlplane_url.is_some() => "controlplane",
        "auto" => "standalone",
        m => m,
    }
}

/// The node credential from `controlplane_token_file`; `auth = controlplane` needs one.
pub fn node_token(cfg: &Config) -> Result<Option<Secret>, String> {
    let Some(p) = &cfg.controlplane_token_file else {
        if mode(cfg) == "controlplane" {
            return Err("auth = controlplane needs controlplane_token_file, this broker's node credential (felixctl node enroll NODE_ID prints one)".into());
        }
        return Ok(None);
    };
    let why = |e: &str| {
        format!(
            "controlplane_token_file {}: {e} (felixctl node enroll {} prints this node's credential)",
            p.display(),
            cfg.node_id
        )
    };
    let t = std::fs::read_to_string(p).map_err(|e| why(&e.to_string()))?;
    let t = t.trim();
    if t.is_empty() {
        return Err(why("empty"));
    }
    Ok(Some(Secret(t.to_string())))
}

/// The keys the cores check tokens with (`None`: auth is off).
pub fn setup(cfg: &Config) -> Result<Option<Arc<AuthKeys>>, String> {
    let keys = match setup_verifier(cfg)? {
        Setup::Off => return Ok(None),
        Setup::Keys(j) => AuthKeys::new(&j)?,
    };
    Ok(Some(Arc::new(keys)))
}

enum Setup {
    Off,
    Keys(Jwks),
}

fn setup_verifier(cfg: &Config) -> Result<Setup, String> {
    match mode(cfg) {
        "controlplane" => {
            // Filled by the control link before the broker reports ready.
            Ok(Setup::Keys(Jwks::default()))
        }
        "off" => {
            tracing::warn!(
                "auth is off: anyone who reaches this broker's port may publish, read and change every tenant's data (--auth auto turns it on)"
            );
            Ok(Setup::Off)
        }
        "standalone" => {
            let key = standalone_key(&cfg.data_dir)?;
            let token = key.issue(&admin_claims(
                "admin",
                &random_hex(8),
                now_s(),
                cfg.auth_admin_token_ttl_s,
            ));
            let path = admin_token_path(&cfg.data_dir);
            write_private(&path, token.as_bytes())?;
            tracing::info!(path = %path.display(), "wrote the admin token");
            Ok(Setup::Keys(Jwks {
                keys: vec![key.jwk()],
            }))
        }
        "jwks" => {
            let path = cfg
                .auth_jwks
                .as_ref()
                .expect("validated: jwks needs auth_jwks");
            let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let jwks: Jwks = serde_json::from_slice(&raw)
                .map_err(|e| format!("{}: not a JWKS: {e}", path.display()))?;
            if jwks.keys.is_empty() {
                return Err(format!("{}: the key set is empty", path.display()));
            }
            Ok(Setup::Keys(jwks))
        }
        other => Err(format!(
            "auth must be auto, standalone, controlplane, jwks or off, got {other:?}"
        )),
    }
}

/// `felix-broker token create --data-dir DIR --tenant T --allow ACTION:PATTERN... [--subject S]
/// [--ttl-s N]`: a token signed with the standalone key of the broker whose data dir is DIR,
/// printed on stdout. `felix-broker token revoke ...`: see [`local_revocations`]. Exit 2 on
/// a usage error.
pub fn token_command(args: &[String]) -> i32 {
    let usage = "usage: felix-broker token create --data-dir DIR --tenant TENANT --allow ACTION:PATTERN [--allow ...] [--subject NAME] [--ttl-s SECONDS]\n       felix-broker token revoke --data-dir DIR (--jti ID | --subject NAME | --tenant TENANT)";
    let mut it = args.iter();
    match it.next().map(String::as_str) {
        Some("create") => {}
        Some("revoke") => return local_revocations::revoke_command(&args[1..]),
        _ => {
            eprintln!("{usage}");
            return 2;
        }
    }
    let (mut dir, mut tenant, mut subject, mut ttl_s) = (None, None, None, 3600u64);
    let mut perms = Vec::new();
    while let Some(flag) = it.next() {
        let Some(v) = it.next() else {
            eprintln!("{flag} needs a value\n{usage}");
            return 2;
        };
        match flag.as_str() {
            "--data-dir" => dir = Some(PathBuf::from(v)),
            "--tenant" => tenant = Some(v.clone()),
            "--subject" => subject = Some(v.clone()),
            "--ttl-s" => match v.parse::<u64>() {
                Ok(n) if n > 0 => ttl_s = n,
                _ => {
                    eprintln!("--ttl-s must be a positive number of seconds, got {v:?}");
                    return 2;
                }
            },
            "--allow" => match Permission::parse(v) {
                Ok(p) => perms.push(p.to_string()),
                Err(e) => {
                    eprintln!("--allow {v}: {e}");
                    return 2;
                }
            },
            other => {
                eprintln!("unknown flag {other}\n{usage}");
                return 2;
            }
        }
    }
    let (Some(dir), Some(tenant)) = (dir, tenant) else {
        eprintln!("{usage}");
        return 2;
    };
    if perms.is_empty() {
        eprintln!("a token needs at least one --allow\n{usage}");
        return 2;
    }
    if !key_path(&dir).exists() {
        eprintln!(
            "{} does not exist: start the broker with --auth standalone and --data-dir {} first",
            key_path(&dir).display(),
            dir.display()
        );
        return 1;
    }
    let key = match standalone_key(&dir) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("felix-broker token: {e}");
            return 1;
        }
    };
    let subject = subject.unwrap_or_else(|| format!("{tenant}-client"));
    // A token made in the second its subject or tenant was revoked would be born revoked
    // (`iat` is whole seconds): it is dated the second after.
    let now = match local_revocations::revoked_at_s(&dir, &subject, &tenant) {
        Some(at_s) => now_s().max(at_s + 1),
        None => now_s(),
    };
    let claims = Claims {
        iss: ISSUER.into(),
        sub: subject,
        tenant,
        perms,
        iat: now,
        nbf: now,
        exp: now.saturating_add(ttl_s),
        jti: random_hex(8),
    };
    println!("{}", key.issue(&claims));
    0
}

//! Admin commands over the control plane's REST API: tenants, namespaces, streams, caches,
//! nodes, shard placement, contexts and shell completions.
//!
//! Output is a table by default and one JSON object per line with `--json`. Deletes ask
//! `[y/N]` at a terminal and need `--yes` anywhere else (exit 2 without it).

use crate::fail::Fail;
use clap::{Args, Subcommand};
use felix_control::api::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

pub const DEFAULT_URL: &str = "https://127.0.0.1:7410";

mod cmds;
pub use cmds::*;

/// What every admin command needs from the global flags.
pub struct Globals {
    pub url: Option<String>,
    pub context: Option<String>,
    pub config: Option<PathBuf>,
    pub tenant: String,
    pub namespace: String,
    pub json: bool,
    pub yes: bool,
    pub timeout: Duration,
    /// Bearer token for the control plane, if any.
    pub token: Option<String>,
    /// CA (PEM) trusted for an `https://` control plane, besides the system's roots.
    pub controlplane_ca: Option<PathBuf>,
}

// ------------------------------------------------------------------ config file

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ConfigFile {
    #[serde(default)]
    pub current_context: Option<String>,
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Context {
    /// Control-plane URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Broker QUIC address (HOST:PORT).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker: Option<String>,
    /// CA certificate that signs the broker's certificate (absolute path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    /// CA certificate that signs the control plane's HTTPS certificate (absolute path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controlplane_ca: Option<PathBuf>,
    /// Token presented to the control plane and the brokers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

pub fn config_path(explicit: &Option<PathBuf>) -> PathBuf {
    if let Some(p) = explicit {
        return p.clone();
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("felix").join("felixctl.json")
}

fn load_config(path: &PathBuf) -> Result<ConfigFile, String> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ConfigFile::default()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

fn save_config(path: &PathBuf, c: &ConfigFile) -> Result<(), String> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let mut b = serde_json::to_vec_pretty(c).expect("config");
    b.push(b'\n');
    // Private: a context may hold a token.
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(io)?;
    f.write_all(&b).map_err(io)
}

/// `--controlplane`/`FELIX_CONTROLPLANE_URL`, else the context (`--context` or the current
/// one), else the default.
fn resolve_url(g: &Globals) -> Result<String, String> {
    if let Some(u) = &g.url {
        check_url(u)?;
        return Ok(u.trim_end_matches('/').to_string());
    }
    let cfg = load_config(&config_path(&g.config))?;
    let name = g.context.clone().or(cfg.current_context.clone());
    let url = match name {
        Some(n) => cfg
            .contexts
            .get(&n)
            .ok_or_else(|| format!("no context {n:?} in {}", config_path(&g.config).display()))?
            .url
            .clone()
            .unwrap_or_else(|| DEFAULT_URL.to_string()),
        None => DEFAULT_URL.to_string(),
    };
    check_url(&url)?;
    Ok(url.trim_end_matches('/').to_string())
}

fn check_url(url: &str) -> Result<(), String> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(())
    } else {
        Err(format!(
            "control-plane URL {url:?} must start with http:// or https://"
        ))
    }
}

/// The context in force (`--context`, else the current one), if any: its name and settings.
pub fn active_context(
    explicit: &Option<String>,
    file: &Option<PathBuf>,
) -> Result<Option<(String, Context)>, String> {
    let cfg = load_config(&config_path(file))?;
    match explicit.clone().or(cfg.current_context.clone()) {
        Some(n) => match cfg.contexts.get(&n) {
            Some(c) => Ok(Some((n, c.clone()))),
            None => Err(format!(
                "no context {n:?} in {}",
                config_path(file).display()
            )),
        },
        None => Ok(None),
    }
}

// ------------------------------------------------------------------ HTTP

pub struct Api {
    base: String,
    http: reqwest::Client,
    token: Option<String>,
}

impl Api {
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, Fail> {
        let url = format!("{}{path}", self.base);
        let mut rq = self.http.request(method, &url);
        if let Some(t) = &self.token {
            rq = rq.bearer_auth(t);
        }
        if let Some(b) = body {
            rq = rq.json(&b);
        }
        let r = rq.send().await.map_err(|e| http_failure(&url, &e))?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        if status.is_success() {
            return Ok(if text.is_empty() {
                Value::Null
            } else {
                serde_json::from_str(&text).unwrap_or(Value::Null)
            });
        }
        match serde_json::from_str::<ErrorBody>(&text) {
            Ok(e) => Err(Fail::refused(
                &e.code,
                format!("{} (HTTP {})", e.message, status.as_u16()),
            )),
            Err(_) => Err(Fail::refused(
                "http_status",
                format!("{url} answered {status}, not a Felix control plane error"),
            )),
        }
    }

    pub async fn get(&self, path: &str) -> Result<Value, Fail> {
        self.call(reqwest::Method::GET, path, None).await
    }
}

/// A request that got no HTTP answer, in words: the URL and the cause at the bottom of the
/// error chain (connection refused, no such host, timed out).
fn http_failure(url: &str, e: &reqwest::Error) -> Fail {
    let mut cause = None;
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        cause = Some(s.to_string());
        src = s.source();
    }
    let cause = cause.unwrap_or_else(|| e.to_string());
    if e.is_builder() {
        Fail::Usage(format!("bad control-plane URL {url}: {cause}"))
    } else if cause.to_ascii_lowercase().contains("certificate") {
        Fail::unreachable(
            "tls",
            format!("the control plane at {url} presented a certificate felixctl does not trust ({cause}); give its CA with --controlplane-ca (FELIX_CONTROLPLANE_CA, or a context's --controlplane-ca)"),
        )
    } else if e.is_timeout() {
        Fail::unreachable(
            "timeout",
            format!("the control plane at {url} did not answer in time ({cause})"),
        )
    } else {
        Fail::unreachable(
            "unreachable",
            format!("no control plane answered at {url}: {cause}"),
        )
    }
}

pub fn seg(s: &str) -> String {
    // Names are one path segment; escape anything that is not unreserved so a bad name reaches
    // the server intact and is refused there with invalid_name.
    let mut o = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            o.push(b as char);
        } else {
            o.push_str(&format!("%{b:02X}"));
        }
    }
    o
}

// ------------------------------------------------------------------ output

pub fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
}

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref()
        .map(|x| x.to_string())
        .unwrap_or_else(|| "-".into())
}

fn json_lines(v: &Value) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| println!("{x}")),
        Value::Null => {}
        x => println!("{x}"),
    }
}

fn from<T: for<'de> Deserialize<'de>>(v: Value) -> Result<T, Fail> {
    serde_json::from_value(v)
        .map_err(|e| Fail::refused("protocol", format!("unexpected answer: {e}")))
}

fn show(json: bool, kind: &str, v: Value) -> Result<(), Fail> {
    if json {
        json_lines(&v);
        return Ok(());
    }
    let many = v.is_array();
    let items: Vec<Value> = match v {
        Value::Array(a) => a,
        Value::Null => vec![],
        x => vec![x],
    };
    match kind {
        "tenant" => {
            let ts: Vec<Tenant> = from(Value::Array(items))?;
            print_table(
                &["NAME", "DESCRIPTION", "REVISION"],
                ts.iter()
                    .map(|t| vec![t.name.clone(), opt(&t.description), t.revision.to_string()])
                    .collect(),
            );
        }
        "namespace" => {
            let ns: Vec<Namespace> = from(Value::Array(items))?;
            print_table(
                &["TENANT", "NAME", "DESCRIPTION", "REVISION"],
                ns.iter()
                    .map(|n| {
                        vec![
                            n.tenant.clone(),
                            n.name.clone(),
                            opt(&n.description),
                            n.revision.to_string(),
                        ]
                    })
                    .collect(),
            );
        }
        "stream" => {
            let ss: Vec<Stream> = from(Value::Array(items))?;
            print_table(
                &[
                    "NAME",
                    "SHARDS",
                    "DURABLE",
                    "RETENTION_BYTES",
                    "RETENTION_SECONDS",
                    "FSYNC",
                    "CONSISTENCY",
                    "RF",
                    "STATE",
                    "PLACED",
                ],
                ss.iter()
                    .map(|s| {
                        let placed = s
                            .placement
                            .iter()
                            .filter(|p| p.state == ShardState::Assigned)
                            .count();
                        vec![
                            s.name.clone(),
                            s.shards.to_string(),
                            s.durable.to_string(),
                            opt(&s.retention_bytes),
                            opt(&s.retention_seconds),
                            enum_name(&s.fsync),
                            enum_name(&s.consistency),
                            s.replication_factor.to_string(),
                            enum_name(&s.state),
                            format!("{placed}/{}", s.shards),
                        ]
                    })
                    .collect(),
            );
        }
        "cache" => {
            let cs: Vec<Cache> = from(Value::Array(items))?;
            print_table(
                &[
                    "NAME",
                    "SHARDS",
                    "DURABLE",
                    "TTL_SECONDS",
                    "STATE",
                    "PLACED",
                ],
                cs.iter()
                    .map(|c| {
                        let placed = c
                            .placement
                            .iter()
                            .filter(|p| p.state == ShardState::Assigned)
                            .count();
                        vec![
                            c.name.clone(),
                            c.shards.to_string(),
                            c.durable.to_string(),
                            opt(&c.ttl_seconds),
                            enum_name(&c.state),
                            format!("{placed}/{}", c.shards),
                        ]
                    })
                    .collect(),
            );
        }
        _ => unreachable!(),
    }
    let _ = many;
    Ok(())
}

fn enum_name<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn parse_enum<T: for<'de> Deserialize<'de>>(
    flag: &str,
    v: &Option<String>,
    allowed: &str,
) -> Result<Option<T>, Fail> {
    match v {
        None => Ok(None),
        Some(s) => serde_json::from_value(Value::String(s.clone()))
            .map(Some)
            .map_err(|_| Fail::Usage(format!("--{flag} must be {allowed}, got {s:?}"))),
    }
}

/// Ask at a terminal; elsewhere `--yes` is required.
pub fn confirm(g: &Globals, what: &str) -> Result<(), Fail> {
    confirm_to(g, "delete", what)
}

/// Ask before `verb what` (`--yes` skips it; without a terminal it refuses).
pub fn confirm_to(g: &Globals, verb: &str, what: &str) -> Result<(), Fail> {
    if g.yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Fail::Usage(format!(
            "refusing to {verb} {what} without --yes (stdin is not a terminal)"
        )));
    }
    eprint!("{verb} {what}? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    if matches!(line.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Fail::Usage(format!("nothing done: {verb} not confirmed")))
    }
}

// ------------------------------------------------------------------ dispatch

/// The REST client: the chosen CA trusted besides the system's roots.
fn http_client(g: &Globals) -> Result<reqwest::Client, Fail> {
    let b = reqwest::Client::builder().timeout(g.timeout);
    felix_control::ca_bundle::trust(b, g.controlplane_ca.as_deref())
        .map_err(|e| Fail::Usage(format!("control-plane CA {e}")))?
        .build()
        .map_err(|e| Fail::refused("internal", e.to_string()))
}

/// Run an admin command.
pub async fn run(cmd: &AdminCmd, g: &Globals) -> Result<(), Fail> {
    use reqwest::Method as M;
    match cmd {
        AdminCmd::Completions { shell } => {
            let mut c = <crate::Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut c, "felixctl", &mut std::io::stdout());
            return Ok(());
        }
        AdminCmd::Context { op } => return context(op, g),
        _ => {}
    }

    let api = Api {
        base: resolve_url(g).map_err(Fail::Usage)?,
        http: http_client(g)?,
        token: g.token.clone(),
    };
    let (t, n) = (seg(&g.tenant), seg(&g.namespace));
    let nsp = format!("/v1/tenants/{t}/namespaces/{n}");
    match cmd {
        AdminCmd::Tenant { op } => {
            scope(&api, g, "tenant", "/v1/tenants".to_string(), op, |name| {
                name.to_string()
            })
            .await
        }
        AdminCmd::Namespace { op } => {
            let tn = g.tenant.clone();
            scope(
                &api,
                g,
                "namespace",
                format!("/v1/tenants/{t}/namespaces"),
                op,
                move |name| format!("{tn}/{name}"),
            )
            .await
        }
        AdminCmd::Stream { op } => {
            let base = format!("{nsp}/streams");
            match op {
                StreamOp::Create {
                    name,
                    shards,
                    durable,
                    f,
                } => {
                    let mut body =
                        serde_json::json!({"name": name, "shards": shards, "durable": durable});
                    stream_fields(&mut body, f)?;
                    let v = api.call(M::POST, &base, Some(body)).await?;
                    show(g.json, "stream", v)
                }
                StreamOp::Get { name } => show(
                    g.json,
                    "stream",
                    api.get(&format!("{base}/{}", seg(name))).await?,
                ),
                StreamOp::Ls => show(g.json, "stream", api.get(&base).await?),
                StreamOp::Set { name, f } => {
                    let mut body = serde_json::json!({});
                    stream_fields(&mut body, f)?;
                    let v = api
                        .call(M::PATCH, &format!("{base}/{}", seg(name)), Some(body))
                        .await?;
                    show(g.json, "stream", v)
                }
                StreamOp::Rm { name } => {
                    confirm(g, &format!("stream {}/{}/{name}", g.tenant, g.namespace))?;
                    let v = api
                        .call(M::DELETE, &format!("{base}/{}", seg(name)), None)
                        .await?;
                    done(g, v, &format!("stream {name} is being deleted"))
                }
            }
        }
        AdminCmd::Cache { op } => {
            let base = format!("{nsp}/caches");
            match op {
                CacheOp::Create {
                    name,
                    shards,
                    durable,
                    ttl_seconds,
                } => {
                    let body = serde_json::json!({"name": name, "shards": shards, "durable": durable, "ttl_seconds": ttl_seconds});
                    show(g.json, "cache", api.call(M::POST, &base, Some(body)).await?)
                }
                CacheOp::Get { name } => show(
                    g.json,
                    "cache",
                    api.get(&format!("{base}/{}", seg(name))).await?,
                ),
                CacheOp::Ls => show(g.json, "cache", api.get(&base).await?),
                CacheOp::Set { name, ttl_seconds } => {
                    let body = serde_json::json!({"ttl_seconds": ttl_seconds});
                    show(
                        g.json,
                        "cache",
                        api.call(M::PATCH, &format!("{base}/{}", seg(name)), Some(body))
                            .await?,
                    )
                }
                CacheOp::Rm { name } => {
                    confirm(g, &format!("cache {}/{}/{name}", g.tenant, g.namespace))?;
                    let v = api
                        .call(M::DELETE, &format!("{base}/{}", seg(name)), None)
                        .await?;
                    done(g, v, &format!("cache {name} is being deleted"))
                }
            }
        }
        AdminCmd::Token { op } => crate::token::token(&api, g, op).await,
        AdminCmd::Key { op } => crate::token::key(&api, g, op).await,
        AdminCmd::Node {
            op:
                NodeOp::Enroll {
                    node_id,
                    ttl,
                    one_time,
                },
        } => crate::token::enroll(&api, g, *node_id, ttl, *one_time).await,
        AdminCmd::Node { op: NodeOp::Ls } => {
            let v = api.get("/v1/brokers").await?;
            let bs: Vec<Broker> = from(v)?;
            // Shards each broker owns, over every stream and cache of the catalog.
            let cat: CatalogSnapshot = from(api.get("/v1/catalog").await?)?;
            let mut owned: BTreeMap<u64, u64> = BTreeMap::new();
            let places = cat
                .streams
                .iter()
                .flat_map(|s| s.placement.iter())
                .chain(cat.caches.iter().flat_map(|c| c.placement.iter()));
            for p in places {
                if let Some(o) = p.owner {
                    *owned.entry(o).or_default() += 1;
                }
            }
            let shards = |id: u64| owned.get(&id).copied().unwrap_or(0);
            if g.json {
                for b in &bs {
                    let mut o = serde_json::to_value(b)
                        .map_err(|e| Fail::refused("internal", e.to_string()))?;
                    o["shards"] = serde_json::json!(shards(b.node_id));
                    println!("{o}");
                }
                return Ok(());
            }
            print_table(
                &[
                    "NODE",
                    "QUIC_ADDR",
                    "PEER_ADDR",
                    "CORES",
                    "LIVE",
                    "INCARNATION",
                    "STORAGE_ID",
                    "SHARDS",
                ],
                bs.iter()
                    .map(|b| {
                        vec![
                            b.node_id.to_string(),
                            b.quic_addr.clone(),
                            b.peer_addr.clone().unwrap_or_else(|| "-".into()),
                            b.cores.to_string(),
                            b.live.to_string(),
                            b.incarnation.to_string(),
                            b.storage_id.clone().unwrap_or_else(|| "-".into()),
                            shards(b.node_id).to_string(),
                        ]
                    })
                    .collect(),
            );
            Ok(())
        }
        AdminCmd::Shard {
            op: ShardOp::Ls { name, cache },
        } => {
            let kind = if *cache { "caches" } else { "streams" };
            let v = api
                .get(&format!("{nsp}/{kind}/{}/shards", seg(name)))
                .await?;
            let ps: Vec<ShardPlacement> = from(v)?;
            let bs: Vec<Broker> = from(api.get("/v1/brokers").await?)?;
            let addr: BTreeMap<u64, String> =
                bs.into_iter().map(|b| (b.node_id, b.quic_addr)).collect();
            // A stream's replication as placement holds it (caches have one copy).
            let rs: BTreeMap<u32, ShardReplication> = if *cache {
                BTreeMap::new()
            } else {
                let r: StreamReplication = from(
                    api.get(&format!("{nsp}/streams/{}/replication", seg(name)))
                        .await?,
                )?;
                r.shards.into_iter().map(|s| (s.shard, s)).collect()
            };
            if g.json {
                // Every column of the table, the owner's address included.
                for p in &ps {
                    let mut o = serde_json::to_value(p)
                        .map_err(|e| Fail::refused("internal", e.to_string()))?;
                    o["quic_addr"] = serde_json::json!(p.owner.and_then(|o| addr.get(&o)));
                    if let Some(r) = rs.get(&p.shard) {
                        o["replication"] = serde_json::to_value(r)
                            .map_err(|e| Fail::refused("internal", e.to_string()))?;
                    }
                    println!("{o}");
                }
                return Ok(());
            }
            print_table(
                &[
                    "SHARD",
                    "OWNER",
                    "QUIC_ADDR",
                    "STATE",
                    "GENERATION",
                    "FOLLOWERS",
                    "COMMIT",
                    "LAG",
                ],
                ps.iter()
                    .map(|p| {
                        let r = rs.get(&p.shard).filter(|r| !r.replicas.is_empty());
                        let list = |v: Vec<String>| {
                            if v.is_empty() {
                                "-".to_string()
                            } else {
                                v.join(",")
                            }
                        };
                        vec![
                            p.shard.to_string(),
                            opt(&p.owner),
                            p.owner
                                .and_then(|o| addr.get(&o).cloned())
                                .unwrap_or_else(|| "-".into()),
                            enum_name(&p.state),
                            p.generation.to_string(),
                            list(r.map_or(Vec::new(), |r| {
                                r.followers.iter().map(u64::to_string).collect()
                            })),
                            opt(&r.and_then(|r| r.commit)),
                            // Each follower's lag behind the leader: records, and bytes as
                            // the leader's last report said (`-` before one named it).
                            list(r.map_or(Vec::new(), |r| {
                                r.replicas
                                    .iter()
                                    .filter(|x| Some(x.node) != r.leader)
                                    .map(|x| {
                                        format!(
                                            "{}:{}:{}",
                                            x.node,
                                            x.lag_records,
                                            opt(&x.lag_bytes)
                                        )
                                    })
                                    .collect()
                            })),
                        ]
                    })
                    .collect(),
            );
            Ok(())
        }
        AdminCmd::Shard {
            op: ShardOp::Abandon { name, shard, to },
        } => abandon(&api, g, &nsp, name, *shard, *to).await,
        AdminCmd::Context { .. } | AdminCmd::Completions { .. } => unreachable!(),
    }
}

/// `shard abandon`: show what would be lost, ask, then promote.
async fn abandon(
    api: &Api,
    g: &Globals,
    nsp: &str,
    name: &str,
    shard: u32,
    to: Option<u64>,
) -> Result<(), Fail> {
    let r: StreamReplication = from(
        api.get(&format!("{nsp}/streams/{}/replication", seg(name)))
            .await?,
    )?;
    let s = r
        .shards
        .iter()
        .find(|x| x.shard == shard && !x.replicas.is_empty())
        .ok_or_else(|| {
            Fail::refused(
                "not_found",
                format!("stream {name} has no replicated shard {shard}"),
            )
        })?;
    // The same choice the control plane makes without --to.
    let pick = to.or_else(|| {
        s.replicas
            .iter()
            .filter(|x| x.live)
            .max_by_key(|x| {
                (
                    x.vouched,
                    x.last_generation,
                    x.end,
                    std::cmp::Reverse(x.node),
                )
            })
            .map(|x| x.node)
    });
    let Some(pick) = pick else {
        return Err(Fail::refused(
            "conflict",
            format!("no replica of shard {shard} of {name} is live: nothing to promote"),
        ));
    };
    let kept =
        s.replicas
            .iter()
            .find(|x| x.node == pick)
            .map_or(0, |x| if x.vouched { x.end } else { 0 });
    let commit = s.commit.unwrap_or(0);
    confirm_to(
        g,
        "abandon",
        &format!(
            "shard {shard} of {name}: promote node {pick}, known to hold the log to offset {kept}; the commit mark is {commit}, so up to {} committed records (acknowledged ones among them) may be lost",
            commit.saturating_sub(kept)
        ),
    )?;
    let v = api
        .call(
            reqwest::Method::POST,
            &format!("{nsp}/streams/{}/shards/{shard}/abandon", seg(name)),
            Some(serde_json::json!({"to": pick, "confirm": true})),
        )
        .await?;
    let msg = format!(
        "shard {shard} of {name}: node {} leads generation {}; up to {} records may be lost",
        v["leader"], v["generation"], v["may_lose_records"]
    );
    done(g, v, &msg)
}

fn done(g: &Globals, v: Value, msg: &str) -> Result<(), Fail> {
    if g.json {
        if v.is_null() {
            println!("{}", serde_json::json!({"deleted": true}));
        } else {
            println!("{v}");
        }
    } else {
        println!("{msg}");
    }
    Ok(())
}

fn stream_fields(body: &mut Value, f: &StreamFields) -> Result<(), Fail> {
    let fsync: Option<FsyncMode> = parse_enum("fsync", &f.fsync, "on_commit, periodic or none")?;
    let consistency: Option<Consistency> =
        parse_enum("consistency", &f.consistency, "leader or quorum")?;
    let o = body.as_object_mut().expect("object");
    let mut put = |k: &str, v: Value| {
        if !v.is_null() {
            o.insert(k.to_string(), v);
        }
    };
    put("retention_bytes", serde_json::json!(f.retention_bytes));
    put("retention_seconds", serde_json::json!(f.retention_seconds));
    put("fsync", serde_json::json!(fsync));
    put("consistency", serde_json::json!(consistency));
    put(
        "replication_factor",
        serde_json::json!(f.replication_factor),
    );
    Ok(())
}

async fn scope(
    api: &Api,
    g: &Globals,
    kind: &str,
    base: String,
    op: &ScopeOp,
    label: impl Fn(&str) -> String,
) -> Result<(), Fail> {
    use reqwest::Method as M;
    match op {
        ScopeOp::Create { name, description } => {
            let body = serde_json::json!({"name": name, "description": description});
            show(g.json, kind, api.call(M::POST, &base, Some(body)).await?)
        }
        ScopeOp::Get { name } => show(
            g.json,
            kind,
            api.get(&format!("{base}/{}", seg(name))).await?,
        ),
        ScopeOp::Ls => show(g.json, kind, api.get(&base).await?),
        ScopeOp::Set { name, description } => {
            let body = serde_json::json!({"description": description});
            show(
                g.json,
                kind,
                api.call(M::PATCH, &format!("{base}/{}", seg(name)), Some(body))
                    .await?,
            )
        }
        ScopeOp::Rm { name } => {
            confirm(g, &format!("{kind} {}", label(name)))?;
            let v = api
                .call(M::DELETE, &format!("{base}/{}", seg(name)), None)
                .await?;
            done(g, v, &format!("{kind} {} deleted", label(name)))
        }
    }
}

fn context(op: &ContextOp, g: &Globals) -> Result<(), Fail> {
    let path = config_path(&g.config);
    let mut cfg = load_config(&path).map_err(Fail::Usage)?;
    match op {
        ContextOp::Ls => {
            let cell = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
            if g.json {
                for (n, c) in &cfg.contexts {
                    println!(
                        "{}",
                        serde_json::json!({"name": n, "url": c.url, "broker": c.broker, "ca": c.ca,
                            "controlplane_ca": c.controlplane_ca,
                            "current": cfg.current_context.as_deref() == Some(n)})
                    );
                }
            } else {
                print_table(
                    &["CURRENT", "NAME", "URL", "BROKER", "CA"],
                    cfg.contexts
                        .iter()
                        .map(|(n, c)| {
                            let cur = if cfg.current_context.as_deref() == Some(n) {
                                "*"
                            } else {
                                ""
                            };
                            vec![
                                cur.to_string(),
                                n.clone(),
                                cell(&c.url),
                                cell(&c.broker),
                                cell(&c.ca.as_ref().map(|p| p.display().to_string())),
                            ]
                        })
                        .collect(),
                );
            }
            Ok(())
        }
        ContextOp::Use { name } => {
            if !cfg.contexts.contains_key(name) {
                return Err(Fail::Usage(format!(
                    "no context {name:?} in {}",
                    path.display()
                )));
            }
            cfg.current_context = Some(name.clone());
            save_config(&path, &cfg).map_err(|e| Fail::refused("io", e))
        }
        ContextOp::Set {
            name,
            url,
            broker,
            ca,
            controlplane_ca,
            token,
        } => {
            let exists = cfg.contexts.contains_key(name);
            if !exists && url.is_none() {
                return Err(Fail::Usage(format!(
                    "a new context needs --url (context {name:?} does not exist in {})",
                    path.display()
                )));
            }
            if let Some(u) = url {
                check_url(u).map_err(Fail::Usage)?;
            }
            if let Some(b) = broker {
                felix_client::resolve_broker(b).map_err(|e| Fail::Usage(e.to_string()))?;
            }
            let absolute = |flag: &str, p: &Option<PathBuf>| -> Result<Option<PathBuf>, Fail> {
                p.as_ref()
                    .map(|p| {
                        std::fs::canonicalize(p)
                            .map_err(|e| Fail::Usage(format!("{flag} {}: {e}", p.display())))
                    })
                    .transpose()
            };
            let ca = absolute("--ca", ca)?;
            let controlplane_ca = absolute("--controlplane-ca", controlplane_ca)?;
            let c = cfg.contexts.entry(name.clone()).or_default();
            if url.is_some() {
                c.url = url.clone();
            }
            if broker.is_some() {
                c.broker = broker.clone();
            }
            if ca.is_some() {
                c.ca = ca;
            }
            if controlplane_ca.is_some() {
                c.controlplane_ca = controlplane_ca;
            }
            if let Some(t) = token {
                c.token = Some(t.trim().to_string());
            }
            if cfg.current_context.is_none() {
                cfg.current_context = Some(name.clone());
            }
            save_config(&path, &cfg).map_err(|e| Fail::refused("io", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With no flag and no context, felixctl talks to a local control plane over HTTPS, its
    /// default (docs/cli.md, "Control plane").
    #[test]
    fn the_default_url_is_https() {
        let dir = tempfile::tempdir().unwrap();
        let g = Globals {
            url: None,
            context: None,
            config: Some(dir.path().join("none.json")),
            tenant: "default".into(),
            namespace: "default".into(),
            json: false,
            yes: false,
            timeout: Duration::from_secs(1),
            token: None,
            controlplane_ca: None,
        };
        assert_eq!(resolve_url(&g).unwrap(), "https://127.0.0.1:7410");
    }
}

//! Tokens and signing keys over the control plane's REST API: `token create|ls|revoke`,
//! `key ls|rotate|rm` and `node enroll` (a broker's node credential).

use crate::admin::{print_table, Api, Globals};
use crate::fail::Fail;
use clap::Subcommand;
use serde_json::{json, Value};

#[derive(Subcommand)]
pub enum TokenOp {
    /// Issue a token for --tenant ('*': every tenant, which needs cluster scope). Prints the
    /// token (with --json, the token and its record); it is shown once and not kept.
    Create {
        /// A permission, ACTION:PATTERN (stream.publish:prod/orders*); repeat for more.
        #[arg(long = "allow", required = true)]
        allow: Vec<String>,
        /// Who it speaks for [default: the tenant's name].
        #[arg(long)]
        subject: Option<String>,
        /// Lifetime: 3600, 90s, 30m, 1h or 7d.
        #[arg(long, default_value = "1h")]
        ttl: String,
    },
    /// List the unexpired tokens of --tenant (or, with --all, of every tenant).
    #[command(alias = "list")]
    Ls {
        /// Every tenant's (needs cluster scope).
        #[arg(long)]
        all: bool,
    },
    /// Revoke one token (--jti, with the tenant's manage), every token of a subject
    /// (--subject) or every token of --tenant (--whole-tenant); the last two need cluster
    /// scope and ask first. Tokens issued until now are refused at once over REST and within
    /// a feed round trip on brokers, which end their subscriptions and watches `revoked`.
    #[command(group(clap::ArgGroup::new("target").required(true).args(["jti", "subject", "whole_tenant"])))]
    Revoke {
        /// A token's id (`token ls` lists them).
        #[arg(long)]
        jti: Option<String>,
        /// Every token of this subject, in every tenant.
        #[arg(long)]
        subject: Option<String>,
        /// Every token of --tenant.
        #[arg(long)]
        whole_tenant: bool,
    },
}

#[derive(Subcommand)]
pub enum KeyOp {
    /// List the signing keys (the newest unretired one signs).
    #[command(alias = "list")]
    Ls,
    /// Add a key that signs from now on; the old one still verifies until removed.
    Rotate,
    /// Remove a retired key: every token it signed stops verifying (asks first).
    #[command(alias = "delete")]
    Rm {
        /// The key id.
        kid: String,
    },
}

/// Seconds of `3600`, `90s`, `30m`, `1h` or `7d`.
pub fn parse_ttl(s: &str) -> Result<u64, Fail> {
    let bad = || {
        Fail::Usage(format!(
            "--ttl {s:?}: a number with an optional s, m, h or d"
        ))
    };
    let (n, unit) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&s[..i], c),
        _ => (s, 's'),
    };
    let n: u64 = n.parse().map_err(|_| bad())?;
    let mult = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).filter(|&v| v > 0).ok_or_else(bad)
}

/// A JSON array answer: one object per line with --json, else a table of `cells` per row.
fn print_rows(g: &Globals, v: &Value, headers: &[&str], cells: impl Fn(&Value) -> Vec<String>) {
    let rows = v.as_array().cloned().unwrap_or_default();
    if g.json {
        for r in rows {
            println!("{r}");
        }
        return;
    }
    print_table(headers, rows.iter().map(cells).collect());
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or("").to_string()
}

fn when(v: &Value) -> String {
    v.as_u64()
        .map(|s| s.to_string())
        .unwrap_or_else(|| "-".into())
}

pub async fn token(api: &Api, g: &Globals, op: &TokenOp) -> Result<(), Fail> {
    use reqwest::Method as M;
    match op {
        TokenOp::Create {
            allow,
            subject,
            ttl,
        } => {
            let body = json!({
                "subject": subject.clone().unwrap_or_else(|| g.tenant.clone()),
                "tenant": g.tenant,
                "perms": allow,
                "ttl_s": parse_ttl(ttl)?,
            });
            let v = api.call(M::POST, "/v1/tokens", Some(body)).await?;
            if g.json {
                println!("{v}");
            } else {
                println!("{}", v["token"].as_str().unwrap_or_default());
            }
            Ok(())
        }
        TokenOp::Ls { all } => {
            let path = if *all {
                "/v1/tokens".to_string()
            } else {
                format!("/v1/tokens?tenant={}", crate::admin::seg(&g.tenant))
            };
            let v = api.get(&path).await?;
            print_rows(
                g,
                &v,
                &["ID", "SUBJECT", "TENANT", "EXPIRES_AT_S", "PERMISSIONS"],
                |r| {
                    vec![
                        text(&r["jti"]),
                        text(&r["subject"]),
                        text(&r["tenant"]),
                        when(&r["expires_at_s"]),
                        r["perms"]
                            .as_array()
                            .map(|p| {
                                p.iter()
                                    .filter_map(|x| x.as_str())
                                    .collect::<Vec<_>>()
                                    .join(",")
                            })
                            .unwrap_or_default(),
                    ]
                },
            );
            Ok(())
        }
        TokenOp::Revoke {
            jti,
            subject,
            whole_tenant,
        } => {
            let body = match (jti, subject) {
                (Some(j), _) => json!({ "jti": j }),
                (None, Some(s)) => {
                    crate::admin::confirm_to(
                        g,
                        "revoke",
                        &format!("every token of subject {s:?} issued until now"),
                    )?;
                    json!({ "subject": s })
                }
                (None, None) => {
                    debug_assert!(*whole_tenant, "clap requires one target");
                    crate::admin::confirm_to(
                        g,
                        "revoke",
                        &format!("every token of tenant {:?} issued until now", g.tenant),
                    )?;
                    json!({ "tenant": g.tenant })
                }
            };
            let v = api.call(M::POST, "/v1/tokens/revoke", Some(body)).await?;
            if g.json {
                println!("{v}");
            } else {
                println!(
                    "revoked {} {} (tokens issued at or before {})",
                    text(&v["kind"]),
                    text(&v["value"]),
                    when(&v["at_s"])
                );
            }
            Ok(())
        }
    }
}

pub async fn key(api: &Api, g: &Globals, op: &KeyOp) -> Result<(), Fail> {
    use reqwest::Method as M;
    let v = match op {
        KeyOp::Ls => api.get("/v1/auth/keys").await?,
        KeyOp::Rotate => api.call(M::POST, "/v1/auth/keys", None).await?,
        KeyOp::Rm { kid } => {
            crate::admin::confirm(
                g,
                &format!("signing key {kid} (every token it signed stops verifying)"),
            )?;
            api.call(
                M::DELETE,
                &format!("/v1/auth/keys/{}", crate::admin::seg(kid)),
                None,
            )
            .await?
        }
    };
    print_rows(g, &v, &["KID", "CREATED_AT_S", "RETIRED_AT_S"], |r| {
        vec![
            text(&r["kid"]),
            when(&r["created_at_s"]),
            when(&r["retired_at_s"]),
        ]
    });
    Ok(())
}

/// Issue broker `node_id`'s node credential and print it (give it to that broker as
/// `--controlplane-token-file`).
pub async fn enroll(
    api: &Api,
    g: &Globals,
    node_id: u64,
    ttl: &Option<String>,
    one_time: bool,
) -> Result<(), Fail> {
    let what = if one_time { "enrolment" } else { "token" };
    let body = match ttl {
        Some(t) => json!({"ttl_s": parse_ttl(t)?}),
        None => json!({}),
    };
    let v = api
        .call(
            reqwest::Method::POST,
            &format!("/v1/nodes/{node_id}/{what}"),
            Some(body),
        )
        .await?;
    if g.json {
        println!("{v}");
    } else {
        println!("{}", v["token"].as_str().unwrap_or_default());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_ttl;

    #[test]
    fn ttls_read_with_units_and_refuse_nonsense() {
        assert_eq!(parse_ttl("3600").unwrap(), 3600);
        assert_eq!(parse_ttl("90s").unwrap(), 90);
        assert_eq!(parse_ttl("30m").unwrap(), 1800);
        assert_eq!(parse_ttl("1h").unwrap(), 3600);
        assert_eq!(parse_ttl("7d").unwrap(), 604_800);
        for bad in ["", "h", "0", "1y", "-1h", "1.5h", "99999999999999999999d"] {
            assert!(parse_ttl(bad).is_err(), "{bad}");
        }
    }
}

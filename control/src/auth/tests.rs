use super::*;

const NOW: u64 = 1_800_000_000;

fn key(kid: &str, b: u8) -> SigningKey {
    SigningKey::from_seed(kid, [b; 32])
}

fn claims(perms: &[&str]) -> Claims {
    Claims {
        iss: ISSUER.into(),
        sub: "alice".into(),
        tenant: "acme".into(),
        perms: perms.iter().map(|s| s.to_string()).collect(),
        iat: NOW,
        nbf: NOW,
        exp: NOW + 3600,
        jti: "t1".into(),
    }
}

fn verifier(keys: &[&SigningKey]) -> Verifier {
    Verifier::new(&Jwks {
        keys: keys.iter().map(|k| k.jwk()).collect(),
    })
    .unwrap()
}

fn b64(s: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(s)
}

#[test]
fn a_token_verifies_and_names_its_principal() {
    let k = key("k1", 7);
    let t = k.issue(&claims(&["stream.publish:prod/orders*"]));
    let p = verifier(&[&k]).verify(&t, NOW + 10).unwrap();
    assert_eq!(p.subject, "alice");
    assert_eq!(p.tenant, "acme");
    assert_eq!(p.expires_at_s, NOW + 3600);
    assert!(p
        .check(Action::StreamPublish, "acme", "prod/orders-eu")
        .is_ok());
    let denied = p
        .check(Action::StreamSubscribe, "acme", "prod/orders-eu")
        .unwrap_err();
    assert!(
        denied.contains("stream.subscribe:prod/orders-eu"),
        "{denied}"
    );
    assert!(p
        .check(Action::StreamPublish, "acme", "prod/payments")
        .is_err());
    assert!(
        p.check(Action::StreamPublish, "other", "prod/orders")
            .is_err(),
        "another tenant"
    );
}

#[test]
fn patterns_match_exactly_or_by_prefix() {
    let p = |s: &str| Permission::parse(s).unwrap();
    assert!(p("cache.read:*").allows(Action::CacheRead, "ns/x"));
    assert!(p("cache.read:ns/*").allows(Action::CacheRead, "ns/x"));
    assert!(!p("cache.read:ns/*").allows(Action::CacheRead, "other/x"));
    assert!(p("cache.read:ns/x").allows(Action::CacheRead, "ns/x"));
    assert!(!p("cache.read:ns/x").allows(Action::CacheRead, "ns/xy"));
    assert!(!p("cache.read:*").allows(Action::CacheWrite, "ns/x"));
    for bad in [
        "publish:*",
        "stream.publish",
        "stream.publish:",
        "stream.publish:a*b",
        "stream.publish:a/b/c",
        "stream.publish:sp ace",
    ] {
        assert!(Permission::parse(bad).is_err(), "{bad}");
    }
    assert_eq!(
        p("group.consume:prod/*").to_string(),
        "group.consume:prod/*"
    );
}

#[test]
fn expiry_and_not_before_use_the_given_clock() {
    let k = key("k1", 7);
    let v = verifier(&[&k]);
    let t = k.issue(&claims(&["manage:*"]));
    assert!(matches!(
        v.verify(&t, NOW + 3600),
        Err(AuthError::Expired(_))
    ));
    let mut early = claims(&["manage:*"]);
    early.nbf = NOW + 600;
    let t = k.issue(&early);
    assert!(matches!(
        v.verify(&t, NOW),
        Err(AuthError::Unauthenticated(_))
    ));
    assert!(
        v.verify(&t, NOW + 600 - NBF_LEEWAY_S).is_ok(),
        "within the leeway"
    );
}

#[test]
fn a_verified_token_is_remembered_but_still_expires() {
    let k = key("k1", 7);
    let v = verifier(&[&k]);
    let t = k.issue(&claims(&["manage:*"]));
    let p = v.verify(&t, NOW).unwrap();
    assert_eq!(v.verify(&t, NOW + 1).unwrap(), p, "remembered");
    assert!(
        matches!(v.verify(&t, NOW + 3600), Err(AuthError::Expired(_))),
        "the expiry is checked on a remembered token"
    );
    // A forgery under the same kid is refused, every time (a refusal is not remembered).
    let forged = key("k1", 9).issue(&claims(&["manage:*"]));
    for _ in 0..2 {
        assert!(matches!(
            v.verify(&forged, NOW),
            Err(AuthError::Unauthenticated(_))
        ));
    }
    // The key removed: a verifier of the keys left verifies afresh, and refuses it.
    assert!(verifier(&[&key("k2", 8)]).verify(&t, NOW).is_err());
}

#[test]
fn hostile_tokens_are_refused_typed() {
    let k = key("k1", 7);
    let other = key("k1", 9); // same kid, another secret: a forgery
    let v = verifier(&[&k]);
    let good = k.issue(&claims(&["manage:*"]));
    let unauth = |t: &str| matches!(v.verify(t, NOW), Err(AuthError::Unauthenticated(_)));
    // Forged: signed by another key under the known kid.
    assert!(unauth(&other.issue(&claims(&["manage:*"]))));
    // Tampered payload, original signature.
    let parts: Vec<&str> = good.split('.').collect();
    let mut c = claims(&["manage:*"]);
    c.tenant = ANY_TENANT.into();
    let tampered = format!(
        "{}.{}.{}",
        parts[0],
        b64(&serde_json::to_vec(&c).unwrap()),
        parts[2]
    );
    assert!(unauth(&tampered));
    // alg: none, no signature.
    let none = format!(
        "{}.{}.",
        b64(br#"{"alg":"none","typ":"JWT","kid":"k1"}"#),
        parts[1]
    );
    assert!(unauth(&none));
    // HS256 with the public key as the secret (the classic confusion).
    let hs = format!(
        "{}.{}.{}",
        b64(br#"{"alg":"HS256","typ":"JWT","kid":"k1"}"#),
        parts[1],
        parts[2]
    );
    assert!(unauth(&hs));
    // An unknown key id.
    assert!(matches!(
        v.verify(&key("k2", 7).issue(&claims(&["manage:*"])), NOW),
        Err(AuthError::UnknownKey(k)) if k == "k2"
    ));
    // A wrong issuer.
    let mut c = claims(&["manage:*"]);
    c.iss = "someone".into();
    assert!(unauth(&k.issue(&c)));
    // A permission that does not parse.
    assert!(unauth(&k.issue(&claims(&["root:*"]))));
    // Garbage, truncated, empty, huge.
    for t in [
        "".to_string(),
        "garbage".into(),
        "a.b.c".into(),
        good[..good.len() / 2].to_string(),
        "x".repeat(1 << 20),
        String::from_utf8_lossy(&[0xff, 0xfe, 0x00, 0x2e]).to_string(),
    ] {
        assert!(unauth(&t), "{:?}", &t[..t.len().min(40)]);
    }
}

#[test]
fn both_keys_verify_during_a_rotation() {
    let old = key("k1", 7);
    let new = key("k2", 8);
    let v = verifier(&[&old, &new]);
    assert!(v.verify(&old.issue(&claims(&["manage:*"])), NOW).is_ok());
    assert!(v.verify(&new.issue(&claims(&["manage:*"])), NOW).is_ok());
    let after = verifier(&[&new]);
    assert!(matches!(
        after.verify(&old.issue(&claims(&["manage:*"])), NOW),
        Err(AuthError::UnknownKey(_))
    ));
}

#[test]
fn a_jwks_with_a_bad_key_is_refused() {
    let mut j = key("k1", 7).jwk();
    j.x = b64(&[1, 2, 3]);
    assert!(Verifier::new(&Jwks { keys: vec![j] }).is_err());
    let mut j = key("k1", 7).jwk();
    j.alg = "HS256".into();
    assert!(Verifier::new(&Jwks { keys: vec![j] }).is_err());
}

#[test]
fn the_admin_token_allows_everything_everywhere() {
    let k = key("k1", 7);
    let t = k.issue(&admin_claims("admin", "boot", NOW, 3600));
    let p = verifier(&[&k]).verify(&t, NOW).unwrap();
    for a in Action::ALL {
        assert!(p.check(a, "any-tenant", "ns/x").is_ok(), "{}", a.name());
    }
}

#[test]
fn a_grant_is_covered_only_by_an_equal_or_wider_pattern_of_the_same_action() {
    let p = |s: &str| Permission::parse(s).unwrap();
    assert!(p("stream.publish:*").covers(&p("stream.publish:prod/orders*")));
    assert!(p("stream.publish:prod/*").covers(&p("stream.publish:prod/orders")));
    assert!(p("stream.publish:prod/o*").covers(&p("stream.publish:prod/orders*")));
    assert!(p("stream.publish:prod/a").covers(&p("stream.publish:prod/a")));
    assert!(!p("stream.publish:prod/a").covers(&p("stream.publish:prod/a*")));
    assert!(!p("stream.publish:prod/orders*").covers(&p("stream.publish:prod/*")));
    assert!(!p("stream.publish:*").covers(&p("stream.subscribe:*")));
}

#[test]
fn a_node_credential_speaks_only_for_its_own_node() {
    let k = key("k", 1);
    let t = k.issue(&node_claims(3, "n3", 1_000, 60));
    let who = verifier(&[&k]).verify(&t, 1_001).unwrap();
    assert!(who
        .check(Action::ClusterAdmin, ANY_TENANT, "brokers/3")
        .is_ok());
    assert!(who
        .check(Action::ClusterAdmin, ANY_TENANT, "catalog")
        .is_ok());
    assert!(who
        .check(Action::ClusterAdmin, ANY_TENANT, "brokers/4")
        .is_err());
    assert!(who
        .check(Action::ClusterAdmin, ANY_TENANT, "tenants")
        .is_err());
    assert!(who.check(Action::StreamPublish, "t", "ns/s").is_err());
}

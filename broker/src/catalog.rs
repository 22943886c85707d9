//! The standalone catalog: streams declared in a YAML file (`--catalog`), with a built-in
//! default (`default/default/events`, 4 shards) so the out-of-the-box start works.

use felix_quic::wire::{validate_name, ErrorCode, StreamName};
use serde::Deserialize;
use std::collections::HashMap;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamDef {
    pub tenant: String,
    pub namespace: String,
    pub stream: String,
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// Persist records in a segment log (needs `durable_storage_dir`).
    #[serde(default)]
    pub durable: bool,
    /// Per-stream fsync mode (on_commit, periodic, none); default `durable_fsync`.
    #[serde(default)]
    pub fsync: Option<String>,
    /// Per-stream retention by size, bytes per shard; default `durable_retention_bytes`.
    #[serde(default)]
    pub retention_bytes: Option<u64>,
    /// Per-stream retention by age, seconds; default `durable_retention_seconds`.
    #[serde(default)]
    pub retention_seconds: Option<u64>,
}

impl StreamDef {
    pub fn name(&self) -> StreamName {
        StreamName::new(&self.tenant, &self.namespace, &self.stream)
    }
}

fn default_shards() -> u32 {
    4
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    streams: Vec<StreamDef>,
}

/// An immutable catalog, identical on every core.
#[derive(Debug, Clone)]
pub struct Catalog {
    streams: Vec<StreamDef>,
    index: HashMap<StreamName, usize>,
}

/// Maximum shards per stream.
pub const SHARDS_MAX: u32 = 4096;

impl Catalog {
    pub fn default_catalog() -> Self {
        Self::from_defs(vec![StreamDef {
            tenant: "default".into(),
            namespace: "default".into(),
            stream: "events".into(),
            shards: 4,
            durable: false,
            fsync: None,
            retention_bytes: None,
            retention_seconds: None,
        }])
        .expect("built-in catalog is valid")
    }

    pub fn from_yaml(text: &str) -> Result<Self, String> {
        let f: CatalogFile = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        Self::from_defs(f.streams)
    }

    pub fn from_defs(streams: Vec<StreamDef>) -> Result<Self, String> {
        let mut index = HashMap::new();
        for (i, s) in streams.iter().enumerate() {
            for n in [&s.tenant, &s.namespace, &s.stream] {
                validate_name(n)?;
            }
            if s.shards == 0 || s.shards > SHARDS_MAX {
                return Err(format!(
                    "stream {}: shards must be 1..={SHARDS_MAX}",
                    s.stream
                ));
            }
            if let Some(f) = &s.fsync {
                felix_storage::FsyncMode::parse(f, 1)
                    .map_err(|e| format!("stream {}: {e}", s.stream))?;
            }
            if !s.durable
                && (s.fsync.is_some()
                    || s.retention_bytes.is_some()
                    || s.retention_seconds.is_some())
            {
                return Err(format!(
                    "stream {}: fsync and retention apply only to durable streams",
                    s.stream
                ));
            }
            let name = StreamName::new(&s.tenant, &s.namespace, &s.stream);
            if index.insert(name.clone(), i).is_some() {
                return Err(format!("stream {name} declared twice"));
            }
        }
        Ok(Catalog { streams, index })
    }

    /// Resolve a stream, with the registry error a client should see.
    pub fn lookup(&self, name: &StreamName) -> Result<(usize, &StreamDef), (ErrorCode, String)> {
        for n in [&name.tenant, &name.namespace, &name.stream] {
            validate_name(n).map_err(|m| (ErrorCode::InvalidName, m))?;
        }
        if let Some(&i) = self.index.get(name) {
            return Ok((i, &self.streams[i]));
        }
        if !self.streams.iter().any(|s| s.tenant == name.tenant) {
            return Err((
                ErrorCode::UnknownTenant,
                format!("tenant {} does not exist", name.tenant),
            ));
        }
        if !self
            .streams
            .iter()
            .any(|s| s.tenant == name.tenant && s.namespace == name.namespace)
        {
            return Err((
                ErrorCode::UnknownNamespace,
                format!(
                    "namespace {}/{} does not exist",
                    name.tenant, name.namespace
                ),
            ));
        }
        Err((
            ErrorCode::UnknownStream,
            format!("stream {name} does not exist"),
        ))
    }

    pub fn streams(&self) -> &[StreamDef] {
        &self.streams
    }
}

/// Shard → core inside one broker: `splitmix64(fnv1a64(tenant 0 namespace 0 stream) ^ shard)
/// mod cores` (docs/protocol.md). Each shard lands on its own hash, so a placement that gives
/// this broker only even shards still spreads them over its cores.
pub fn core_for_shard(name: &StreamName, shard: u32, cores: u32) -> u32 {
    use felix_quic::wire::hash::{fnv1a64, fnv1a64_from};
    let mut h = fnv1a64(name.tenant.as_bytes());
    h = fnv1a64_from(h, &[0]);
    h = fnv1a64_from(h, name.namespace.as_bytes());
    h = fnv1a64_from(h, &[0]);
    h = fnv1a64_from(h, name.stream.as_bytes());
    (splitmix64(h ^ shard as u64) % cores as u64) as u32
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_errors_are_typed() {
        let c = Catalog::default_catalog();
        assert!(c
            .lookup(&StreamName::new("default", "default", "events"))
            .is_ok());
        assert_eq!(
            c.lookup(&StreamName::new("nope", "default", "events"))
                .unwrap_err()
                .0,
            ErrorCode::UnknownTenant
        );
        assert_eq!(
            c.lookup(&StreamName::new("default", "x", "events"))
                .unwrap_err()
                .0,
            ErrorCode::UnknownNamespace
        );
        assert_eq!(
            c.lookup(&StreamName::new("default", "default", "x"))
                .unwrap_err()
                .0,
            ErrorCode::UnknownStream
        );
        assert_eq!(
            c.lookup(&StreamName::new("a/b", "default", "x"))
                .unwrap_err()
                .0,
            ErrorCode::InvalidName
        );
    }

    #[test]
    fn yaml_catalog_refuses_bad_input() {
        assert!(Catalog::from_yaml(
            "streams:\n  - {tenant: t, namespace: n, stream: s, shards: 2}\n"
        )
        .is_ok());
        assert!(Catalog::from_yaml(
            "streams:\n  - {tenant: t, namespace: n, stream: s, shards: 0}\n"
        )
        .is_err());
        assert!(Catalog::from_yaml(
            "streams:\n  - {tenant: t, namespace: n, stream: s, bogus: 1}\n"
        )
        .is_err());
        assert!(Catalog::from_yaml("streams:\n  - {tenant: t, namespace: n, stream: s}\n  - {tenant: t, namespace: n, stream: s}\n").is_err());
    }

    #[test]
    fn even_shards_spread_over_two_cores() {
        // A two-broker placement gives this broker shards 0, 2, 4, ...: both cores get some.
        let n = StreamName::new("default", "default", "events");
        let cores: std::collections::HashSet<u32> = (0..16)
            .step_by(2)
            .map(|s| core_for_shard(&n, s, 2))
            .collect();
        assert_eq!(cores.len(), 2);
        for s in 0..64 {
            assert!(core_for_shard(&n, s, 3) < 3);
        }
    }
}

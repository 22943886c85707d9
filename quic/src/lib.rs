//! felix-quic: the Felix protocol over QUIC — frame codec (`wire`), TLS on BoringSSL (`tls`),
//! the runtime-agnostic connection core (`conn`), a glommio driver for the broker
//! (`glommio_driver`) and a tokio driver for clients (`tokio_driver`).

pub mod conn;
pub mod idmap;
pub mod server;
pub mod tls;
pub mod udp;
pub mod wire;

#[cfg(feature = "glommio-driver")]
pub mod glommio_driver;
#[cfg(feature = "tokio-driver")]
pub mod tokio_driver;

/// Bytes of one packet buffer: quiche never builds a packet larger than 16,383 bytes once a
/// connection is established (so a two-byte varint can encode its length), and 1,200 before.
pub const UDP_PAYLOAD_SLOT: usize = 16_383;
/// Smallest UDP payload a QUIC path must carry (RFC 9000 §14), and the size Felix starts at.
pub const UDP_PAYLOAD_MIN: usize = 1_200;
/// Default ceiling of the UDP payloads Felix sends and accepts. Path MTU discovery (DPLPMTUD,
/// RFC 9000 §14.3) finds what the path really carries below it: ~1,450 on Ethernet, ~8,950 on
/// jumbo frames, the whole ceiling on loopback. 16,250 so that four packets fill one GSO send
/// ([`udp::UDP_PAYLOAD_SUM_MAX`]). Why it matters: every packet costs quiche framing,
/// recovery state, an AEAD seal/open and header protection; at 1,350 bytes those dominated
/// (bench-results/2026-12-04-pmtud.md).
pub const DEFAULT_UDP_PAYLOAD_MAX: usize = 16_250;
/// Connection id length used by Felix servers.
pub const CONN_ID_LEN: usize = 16;

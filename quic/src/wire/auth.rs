//! Authentication frames (kinds 50–51): a client presents its token on the control stream
//! after `Hello`, and may present a fresh one at any time on a live connection (re-auth in
//! place, before the old one expires).
//!
//! - `Authenticate` carries the request id and the token (a JWT, at most
//!   [`TOKEN_BYTES_MAX`] bytes).
//! - `Authenticated` answers it with the subject and tenant the broker verified and when the
//!   token expires (milliseconds since the Unix epoch). A refusal is an `Error`
//!   (`unauthenticated`, `token_expired`, `revoked`).

use super::{put_str, Reader, WireError};
use bytes::{BufMut, BytesMut};

/// The largest token a frame carries (the verifier's own bound is the same).
pub const TOKEN_BYTES_MAX: usize = 8 * 1024;

/// Frame kinds of this module (stable numbers, after `ClusterInfo`).
pub mod kind {
    pub const AUTHENTICATE: u8 = 50;
    pub const AUTHENTICATED: u8 = 51;
    pub const FIRST: u8 = AUTHENTICATE;
    pub const LAST: u8 = AUTHENTICATED;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthFrame {
    Authenticate {
        request_id: u64,
        token: String,
    },
    Authenticated {
        request_id: u64,
        subject: String,
        tenant: String,
        expires_at_ms: u64,
    },
}

impl AuthFrame {
    pub fn kind(&self) -> u8 {
        match self {
            AuthFrame::Authenticate { .. } => kind::AUTHENTICATE,
            AuthFrame::Authenticated { .. } => kind::AUTHENTICATED,
        }
    }

    pub fn request_id(&self) -> u64 {
        match self {
            AuthFrame::Authenticate { request_id, .. }
            | AuthFrame::Authenticated { request_id, .. } => *request_id,
        }
    }

    pub(super) fn encode_body(&self, b: &mut BytesMut) {
        match self {
            AuthFrame::Authenticate { request_id, token } => {
                b.put_u64_le(*request_id);
                b.put_u32_le(token.len() as u32);
                b.put_slice(token.as_bytes());
            }
            AuthFrame::Authenticated {
                request_id,
                subject,
                tenant,
                expires_at_ms,
            } => {
                b.put_u64_le(*request_id);
                put_str(b, subject);
                put_str(b, tenant);
                b.put_u64_le(*expires_at_ms);
            }
        }
    }

    pub(super) fn decode(k: u8, r: &mut Reader) -> Result<AuthFrame, WireError> {
        Ok(match k {
            kind::AUTHENTICATE => {
                let request_id = r.u64("request_id")?;
                let n = r.u32("token_len")? as usize;
                if n > TOKEN_BYTES_MAX {
                    return Err(WireError::InvalidValue {
                        field: "token_len",
                        value: n as u64,
                    });
                }
                let raw = r.take(n, "token")?;
                let token =
                    String::from_utf8(raw.to_vec()).map_err(|_| WireError::InvalidValue {
                        field: "token",
                        value: n as u64,
                    })?;
                AuthFrame::Authenticate { request_id, token }
            }
            kind::AUTHENTICATED => AuthFrame::Authenticated {
                request_id: r.u64("request_id")?,
                subject: r.string("subject")?,
                tenant: r.string("tenant")?,
                expires_at_ms: r.u64("expires_at_ms")?,
            },
            other => {
                return Err(WireError::InvalidValue {
                    field: "kind",
                    value: other as u64,
                })
            }
        })
    }
}

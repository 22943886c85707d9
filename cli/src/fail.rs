//! How felixctl fails: one type for every command, one exit code per kind of failure, and
//! errors printed for people (or as one JSON object on stderr under `--json`).

/// Exit codes (also in `felixctl --help` and docs/cli.md).
pub mod exit {
    pub const OK: i32 = 0;
    /// The broker or the control plane refused (a typed error: its code is printed).
    pub const REFUSED: i32 = 1;
    /// Bad flags or arguments; nothing was sent.
    pub const USAGE: i32 = 2;
    /// Nothing answered: no broker or control plane at the address, TLS refused, timed out,
    /// or the connection was lost.
    pub const UNREACHABLE: i32 = 3;
    /// Some of the work was done and some refused (e.g. records of a publish); each refusal
    /// was printed.
    pub const PARTIAL: i32 = 4;
    /// Ended by Ctrl-C (SIGINT): a clean end of a subscribe, watch or poll.
    pub const INTERRUPTED: i32 = 130;
}

/// The `--help` text on exit codes.
pub const EXIT_CODES_HELP: &str = "Exit codes: 0 ok; 1 refused by the broker or control plane \
(its error code is printed); 2 usage error, nothing sent; 3 unreachable (nothing answered, TLS \
refused, timed out, connection lost); 4 partial success (some records or claims refused, each \
named); 130 ended by Ctrl-C. With --json, errors are one JSON object on stderr: \
{\"error\":{\"code\":...,\"message\":...,\"exit\":...}}.";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fail {
    /// Bad input; nothing was sent.
    Usage(String),
    /// A typed refusal: `code` is the registry name (or `not_found` for a missing key).
    Refused { code: String, message: String },
    /// Nothing answered (or the connection broke).
    Unreachable { code: String, message: String },
    /// Part of the work was refused; the refusals were printed as they happened.
    Partial(String),
    /// Ctrl-C.
    Interrupted,
}

impl Fail {
    pub fn refused(code: &str, message: impl Into<String>) -> Fail {
        Fail::Refused {
            code: code.into(),
            message: message.into(),
        }
    }

    pub fn unreachable(code: &str, message: impl Into<String>) -> Fail {
        Fail::Unreachable {
            code: code.into(),
            message: message.into(),
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self {
            Fail::Usage(_) => exit::USAGE,
            Fail::Refused { .. } => exit::REFUSED,
            Fail::Unreachable { .. } => exit::UNREACHABLE,
            Fail::Partial(_) => exit::PARTIAL,
            Fail::Interrupted => exit::INTERRUPTED,
        }
    }

    /// `(code, message)` as printed.
    pub fn parts(&self) -> (&str, String) {
        match self {
            Fail::Usage(m) => ("usage", m.clone()),
            Fail::Refused { code, message } | Fail::Unreachable { code, message } => {
                (code, message.clone())
            }
            Fail::Partial(m) => ("partial", m.clone()),
            Fail::Interrupted => ("interrupted", "interrupted".into()),
        }
    }

    /// Print to stderr (for people, or one JSON object) and give the exit code.
    pub fn report(&self, json: bool) -> i32 {
        let (code, message) = self.parts();
        if json {
            eprintln!(
                "{}",
                serde_json::json!({"error": {"code": code, "message": message, "exit": self.exit_code()}})
            );
        } else if !matches!(self, Fail::Interrupted) {
            match self {
                Fail::Refused { .. } => eprintln!("felixctl: refused ({code}): {message}"),
                _ => eprintln!("felixctl: {message}"),
            }
        }
        self.exit_code()
    }
}

impl From<felix_client::Error> for Fail {
    fn from(e: felix_client::Error) -> Fail {
        use felix_client::Error as E;
        let m = e.to_string();
        match e {
            E::Broker { code, message } => Fail::refused(code.name(), message),
            E::UnknownBrokerError { number, message } => {
                Fail::refused(&format!("error_{number}"), message)
            }
            E::InvalidArgument(m) => Fail::Usage(m),
            E::Address { .. } | E::FrameTooLarge { .. } => Fail::Usage(m),
            E::Unreachable { .. } | E::Connect(..) => Fail::unreachable("unreachable", m),
            E::Tls(_) => Fail::unreachable("tls", m),
            E::Timeout(_) => Fail::unreachable("timeout", m),
            E::Closed(_) => Fail::unreachable("closed", m),
            E::Protocol(_) => Fail::refused("protocol", m),
        }
    }
}

/// A subscription or watch end in words: the code's registry name and the message.
pub fn end_code_name(code: u16) -> String {
    match code {
        0 => "normal".into(),
        u16::MAX => "connection_closed".into(),
        n => felix_quic::wire::ErrorCode::from_number(n)
            .map(|c| c.name().to_string())
            .unwrap_or_else(|| format!("error_{n}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_quic::wire::ErrorCode;

    #[test]
    fn client_errors_map_to_distinct_exit_codes() {
        let refused: Fail = felix_client::Error::Broker {
            code: ErrorCode::UnknownStream,
            message: "no".into(),
        }
        .into();
        assert_eq!(refused.exit_code(), exit::REFUSED);
        assert_eq!(refused.parts().0, "unknown_stream");
        let gone: Fail = felix_client::Error::Unreachable {
            addr: "x:1".into(),
            waited: std::time::Duration::from_millis(5),
        }
        .into();
        assert_eq!(gone.exit_code(), exit::UNREACHABLE);
        let usage: Fail = felix_client::Error::FrameTooLarge { len: 9, max: 8 }.into();
        assert_eq!(usage.exit_code(), exit::USAGE);
        assert_eq!(Fail::Partial("p".into()).exit_code(), exit::PARTIAL);
        assert_eq!(Fail::Interrupted.exit_code(), 130);
        let codes = [
            exit::OK,
            exit::REFUSED,
            exit::USAGE,
            exit::UNREACHABLE,
            exit::PARTIAL,
            exit::INTERRUPTED,
        ];
        let distinct: std::collections::HashSet<_> = codes.iter().collect();
        assert_eq!(distinct.len(), codes.len());
    }

    #[test]
    fn end_codes_are_named() {
        assert_eq!(end_code_name(0), "normal");
        assert_eq!(end_code_name(23), "stream_deleted");
        assert_eq!(end_code_name(u16::MAX), "connection_closed");
        assert_eq!(end_code_name(999), "error_999");
    }
}

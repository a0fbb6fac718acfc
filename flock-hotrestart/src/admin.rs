//! A minimal client for Envoy's admin endpoint: `GET /server_info` (is epoch N LIVE?)
//! and `POST /drain_listeners?graceful` (graceful shutdown).
//!
//! HTTP/1.1 over one short-lived TCP connection (`Connection: close`), bounded by a
//! timeout. Envoy answers admin requests with `transfer-encoding: chunked`, which is
//! decoded here; nothing else of HTTP is needed, so no HTTP stack is pulled in.
//!
//! Envoy hands the admin listener to the new epoch during a hot restart, so the epoch
//! and base id in the answer (`command_line_options.restart_epoch` / `base_id`) say
//! which process answered: "epoch N is LIVE" is `state == LIVE && restart_epoch == N`.

use std::fmt;
use std::io;
use std::time::Duration;

use flock_core::epoch::PredecessorStatus;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The largest admin response read, in bytes (`/server_info` is ~120 KiB on 1.40).
const MAX_RESPONSE_BYTES: usize = 4 << 20;

/// What `/server_info` said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// `state`: `LIVE`, `DRAINING`, `PRE_INITIALIZING` or `INITIALIZING`.
    pub state: String,
    /// `command_line_options.restart_epoch`.
    pub epoch: u32,
    /// `command_line_options.base_id`.
    pub base_id: u32,
}

impl ServerInfo {
    /// Whether the answering Envoy is LIVE.
    pub fn is_live(&self) -> bool {
        self.state == "LIVE"
    }

    /// As the input of [`flock_core::epoch::start_epoch`].
    pub fn status(&self) -> PredecessorStatus {
        if self.is_live() {
            PredecessorStatus::Live {
                epoch: self.epoch,
                base_id: self.base_id,
            }
        } else {
            PredecessorStatus::NotLive {
                epoch: self.epoch,
                base_id: self.base_id,
            }
        }
    }
}

impl fmt::Display for ServerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "epoch {} of base id {} {}",
            self.epoch, self.base_id, self.state
        )
    }
}

/// A client of one admin address (`HOST:PORT`).
#[derive(Clone, Debug)]
pub struct AdminClient {
    address: String,
    timeout: Duration,
}

impl AdminClient {
    /// A client of `address` whose requests each take at most `timeout`.
    pub fn new(address: impl Into<String>, timeout: Duration) -> Self {
        Self {
            address: address.into(),
            timeout,
        }
    }

    /// The admin address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// `GET /server_info`.
    pub async fn server_info(&self) -> io::Result<ServerInfo> {
        let body = self.request("GET", "/server_info").await?;
        parse_server_info(&body)
    }

    /// `/server_info` as a [`PredecessorStatus`]; any error is `Unreachable`.
    pub async fn probe(&self) -> PredecessorStatus {
        match self.server_info().await {
            Ok(info) => info.status(),
            Err(_) => PredecessorStatus::Unreachable,
        }
    }

    /// `POST /drain_listeners?graceful`: Envoy stops accepting after its drain time
    /// and asks HTTP clients to close connections meanwhile.
    pub async fn drain_listeners_gracefully(&self) -> io::Result<()> {
        self.request("POST", "/drain_listeners?graceful")
            .await
            .map(drop)
    }

    async fn request(&self, method: &str, path: &str) -> io::Result<Vec<u8>> {
        let exchange = async {
            let mut stream = TcpStream::connect(&self.address).await?;
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
                self.address
            );
            stream.write_all(head.as_bytes()).await?;
            let mut raw = Vec::new();
            (&mut stream)
                .take(MAX_RESPONSE_BYTES as u64)
                .read_to_end(&mut raw)
                .await?;
            parse_response(&raw)
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "admin {} did not answer in {:?}",
                        self.address, self.timeout
                    ),
                )
            })?
    }
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Parses a whole `Connection: close` HTTP/1.1 response; returns the body of a 200.
/// Never panics on any input (fuzzed: `fuzz/fuzz_targets/admin_response.rs`).
pub fn parse_response(raw: &[u8]) -> io::Result<Vec<u8>> {
    let end = find(raw, b"\r\n\r\n").ok_or_else(|| invalid("truncated HTTP response head"))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| invalid("non-UTF-8 head"))?;
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let code = status.split(' ').nth(1).unwrap_or_default();
    if code != "200" {
        return Err(invalid(format!("admin answered {status:?}")));
    }
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = value.parse::<usize>().ok();
        }
    }
    let body = &raw[end + 4..];
    if chunked {
        return decode_chunked(body);
    }
    match length {
        Some(n) if body.len() >= n => Ok(body[..n].to_vec()),
        Some(_) => Err(invalid("truncated HTTP body")),
        None => Ok(body.to_vec()),
    }
}

fn decode_chunked(mut body: &[u8]) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = find(body, b"\r\n").ok_or_else(|| invalid("truncated chunk size"))?;
        let size_text =
            std::str::from_utf8(&body[..line_end]).map_err(|_| invalid("chunk size"))?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size =
            usize::from_str_radix(size_text, 16).map_err(|_| invalid("malformed chunk size"))?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        // A hostile size (e.g. ffffffffffffffff) must not overflow.
        if size.checked_add(2).is_none_or(|needed| body.len() < needed) {
            return Err(invalid("truncated chunk"));
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Parses the JSON of `/server_info`. Never panics on any input (fuzzed).
pub fn parse_server_info(body: &[u8]) -> io::Result<ServerInfo> {
    let json: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("server_info JSON: {e}")))?;
    let state = json
        .get("state")
        .and_then(|s| s.as_str())
        .ok_or_else(|| invalid("server_info has no state"))?
        .to_owned();
    let options = json
        .get("command_line_options")
        .ok_or_else(|| invalid("server_info has no command_line_options"))?;
    let number = |key: &str| -> io::Result<u32> {
        let value = options
            .get(key)
            .ok_or_else(|| invalid(format!("server_info has no {key}")))?;
        // proto3 JSON prints 64-bit integers as strings, 32-bit ones as numbers.
        let n = match value {
            serde_json::Value::Number(n) => n.as_u64(),
            serde_json::Value::String(s) => s.parse::<u64>().ok(),
            _ => None,
        };
        n.and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| invalid(format!("server_info {key} is not a u32: {value}")))
    };
    Ok(ServerInfo {
        state,
        epoch: number("restart_epoch")?,
        base_id: number("base_id")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_chunk_size_is_an_error_not_an_overflow() {
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nffffffffffffffff\r\nab\r\n0\r\n\r\n";
        assert!(parse_response(raw).is_err());
    }

    #[test]
    fn decodes_a_chunked_200() {
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n";
        assert_eq!(parse_response(raw).unwrap(), b"hello world");
    }

    #[test]
    fn honours_content_length_and_rejects_other_statuses() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokXX";
        assert_eq!(parse_response(raw).unwrap(), b"ok");
        let raw = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n";
        assert!(parse_response(raw).is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nff\r\nshort";
        assert!(parse_response(raw).is_err());
    }

    #[test]
    fn parses_server_info_both_integer_spellings() {
        let body = br#"{"state":"LIVE","command_line_options":{"restart_epoch":3,"base_id":"77"}}"#;
        let info = parse_server_info(body).unwrap();
        assert_eq!(
            info,
            ServerInfo {
                state: "LIVE".into(),
                epoch: 3,
                base_id: 77
            }
        );
        assert_eq!(
            info.status(),
            PredecessorStatus::Live {
                epoch: 3,
                base_id: 77
            }
        );
        let body =
            br#"{"state":"INITIALIZING","command_line_options":{"restart_epoch":4,"base_id":77}}"#;
        assert_eq!(
            parse_server_info(body).unwrap().status(),
            PredecessorStatus::NotLive {
                epoch: 4,
                base_id: 77
            }
        );
        assert!(parse_server_info(b"{}").is_err());
        assert!(parse_server_info(b"not json").is_err());
    }
}

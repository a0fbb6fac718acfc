//! The admin endpoint: `/healthz`, `/readyz`, `/metrics` (Prometheus text) and the
//! JSON views `/debug/status`, `/debug/pods`, `/debug/snapshot`, `/debug/registry`.
//!
//! - [`api`]: the documents, one serde type per view, used by both sides (the
//!   `flock-admin` crate's, re-exported).
//! - [`server`]: HTTP/1.1 on hyper; GET only, a cap on concurrent connections, and
//!   backoff on accept errors (a process out of file descriptors must not spin).
//! - [`client`]: the typed client `flockctl` uses, on hyper, with timeouts and a
//!   body size limit (`flock-admin`'s, re-exported).
//!
//! [`route`] is the only decision taken on what a client sent (hyper parses the
//! request); it is pure, so it is fuzzed (`fuzz/fuzz_targets/admin_request.rs`).

pub use flock_admin::{api, client};
pub mod server;

pub use api::Route;
pub use server::{ServeOptions, serve, serve_agent, serve_with};

/// The longest method name echoed back in an error.
const MAX_METHOD_ECHO: usize = 16;

/// Why a request was refused, with the HTTP status it gets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Anything but GET.
    #[error("only GET is served here, not {0}")]
    Method(String),
    /// No such path.
    #[error("not found; try {}", Route::ALL.map(Route::path).join(" "))]
    NotFound,
}

impl Refusal {
    /// The HTTP status for this refusal.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Method(_) => 405,
            Refusal::NotFound => 404,
        }
    }
}

/// The route for a request's method and path (without its query).
///
/// A wrong method is refused before the path is looked at (405 even for an unknown
/// path), as before; the method came from the network, so only a bounded, printable
/// prefix of it is echoed back.
pub fn route(method: &str, path: &str) -> Result<Route, Refusal> {
    if method != "GET" {
        let shown: String = method
            .chars()
            .take(MAX_METHOD_ECHO)
            .map(|c| if c.is_ascii_graphic() { c } else { '?' })
            .collect();
        return Err(Refusal::Method(shown));
    }
    Route::from_path(path).ok_or(Refusal::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gets_of_known_paths_route_and_the_rest_are_refused() {
        assert_eq!(route("GET", "/metrics"), Ok(Route::Metrics));
        assert_eq!(route("GET", "/debug/pods"), Ok(Route::Pods));
        assert_eq!(route("GET", "/nope").unwrap_err().status(), 404);
        assert_eq!(route("POST", "/healthz").unwrap_err().status(), 405);
        assert_eq!(route("DELETE", "/nope").unwrap_err().status(), 405);
        assert!(
            Refusal::NotFound
                .to_string()
                .contains("/healthz /readyz /metrics")
        );
    }

    #[test]
    fn an_echoed_method_is_bounded_and_printable() {
        let long = "X".repeat(100);
        assert_eq!(
            route(&long, "/"),
            Err(Refusal::Method("X".repeat(MAX_METHOD_ECHO)))
        );
        assert_eq!(route("G\u{7}T", "/"), Err(Refusal::Method("G?T".into())));
    }
}

//! The one logging setup of flock's binaries.
//!
//! Logs go to stderr (stdout is reserved for a binary's output: the CNI plugin's
//! result, `flockctl`'s tables). The filter comes from `RUST_LOG` (the usual
//! `tracing-subscriber` directives, e.g. `info,flock_bird=debug`); when it is unset
//! the default is `info`, and when it does not parse the default is used and a
//! warning says so instead of logging nothing.

use std::str::FromStr;
use tracing_subscriber::EnvFilter;

/// The filter used when `RUST_LOG` is unset or invalid.
pub const DEFAULT_FILTER: &str = "info";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines, coloured when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl LogFormat {
    /// The accepted spellings, for argument parsers' value lists.
    pub const NAMES: [&'static str; 2] = ["text", "json"];
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("log format {other:?}: expected text or json")),
        }
    }
}

/// The filter for a `RUST_LOG` value (`None`: unset), and the reason it was not used
/// when it does not parse.
pub fn filter_for(rust_log: Option<&str>) -> (EnvFilter, Option<String>) {
    match rust_log {
        None => (EnvFilter::new(DEFAULT_FILTER), None),
        Some(directives) => match EnvFilter::try_new(directives) {
            Ok(f) => (f, None),
            Err(e) => (
                EnvFilter::new(DEFAULT_FILTER),
                Some(format!(
                    "RUST_LOG={directives:?} does not parse ({e}); logging at {DEFAULT_FILTER}"
                )),
            ),
        },
    }
}

/// Installs the global subscriber: filter from `RUST_LOG` (default [`DEFAULT_FILTER`]),
/// lines on stderr in `format`. Call once, before anything logs; a second call (or a
/// subscriber installed by a test harness) is left in place.
pub fn init(format: LogFormat) {
    let rust_log = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    let (filter, warning) = filter_for(rust_log.as_deref());
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    let installed = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if installed.is_ok()
        && let Some(w) = warning
    {
        tracing::warn!("{w}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_by_name() {
        for name in LogFormat::NAMES {
            assert!(name.parse::<LogFormat>().is_ok(), "{name}");
        }
        assert_eq!("json".parse(), Ok(LogFormat::Json));
        assert!("yaml".parse::<LogFormat>().is_err());
    }

    #[test]
    fn an_unset_or_broken_rust_log_falls_back_to_the_default() {
        let (f, w) = filter_for(None);
        assert_eq!(f.to_string(), DEFAULT_FILTER);
        assert!(w.is_none());
        let (f, w) = filter_for(Some("debug,flock_bird=trace"));
        assert!(f.to_string().contains("flock_bird=trace"), "{f}");
        assert!(w.is_none());
        let (f, w) = filter_for(Some("flock_bird=notalevel"));
        assert_eq!(f.to_string(), DEFAULT_FILTER);
        assert!(w.unwrap().contains("does not parse"));
    }
}

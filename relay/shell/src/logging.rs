//! Log output of the binaries: `tracing` to stderr, configured from the environment the way
//! Dynamo's processes are.
//!
//! - Levels: `DYN_LOG` (Dynamo's variable, `tracing` filter syntax such as `info` or
//!   `warn,kvrelay=debug`), else `RUST_LOG`, else `info`. A `DYN_LOG` that does not parse falls
//!   back to the next source and says so in the first log line.
//! - Format: one JSON object per line when `DYN_LOGGING_JSONL` is truthy (`1/true/yes/on`,
//!   case-insensitive): `timestamp`, `level`, `target`, the event's fields (`message` among
//!   them) and its spans; human-readable lines otherwise.
//! - Colour: ANSI escapes only when stderr is a terminal and the format is not JSON, so a file,
//!   a pipe or a log collector never receives escape codes.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Where the level filter came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FilterSource {
    /// `DYN_LOG`.
    DynLog,
    /// `RUST_LOG`.
    RustLog,
    /// Neither was set (or usable): `info`.
    Default,
}

/// The logging configuration read from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSettings {
    /// The filter directives in effect.
    pub filter: String,
    /// Where they came from.
    pub source: FilterSource,
    /// JSON lines (`DYN_LOGGING_JSONL`).
    pub jsonl: bool,
    /// A `DYN_LOG` value that did not parse, if any.
    pub rejected_dyn_log: Option<String>,
}

fn truthy(value: &str) -> bool {
    matches!(value.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

fn parses(directives: &str) -> bool {
    EnvFilter::try_new(directives).is_ok()
}

impl LogSettings {
    /// Read the settings through `lookup` (the process environment in the binaries).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        let jsonl = set("DYN_LOGGING_JSONL").is_some_and(|value| truthy(&value));
        let mut rejected_dyn_log = None;
        if let Some(directives) = set("DYN_LOG") {
            if parses(&directives) {
                return LogSettings {
                    filter: directives,
                    source: FilterSource::DynLog,
                    jsonl,
                    rejected_dyn_log,
                };
            }
            rejected_dyn_log = Some(directives);
        }
        match set("RUST_LOG").filter(|directives| parses(directives)) {
            Some(filter) => {
                LogSettings { filter, source: FilterSource::RustLog, jsonl, rejected_dyn_log }
            }
            None => LogSettings {
                filter: "info".to_owned(),
                source: FilterSource::Default,
                jsonl,
                rejected_dyn_log,
            },
        }
    }

    /// Whether lines carry ANSI colour: only human-readable lines to a terminal.
    #[must_use]
    pub fn ansi(&self, stderr_is_terminal: bool) -> bool {
        stderr_is_terminal && !self.jsonl
    }
}

/// Install the global subscriber for a binary, from the process environment. Calling it twice
/// keeps the first subscriber.
pub fn init() {
    let settings = LogSettings::from_lookup(|name| std::env::var(name).ok());
    let filter = EnvFilter::try_new(&settings.filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let installed = if settings.jsonl {
        tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init()
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(settings.ansi(std::io::stderr().is_terminal()))
            .try_init()
    };
    if installed.is_ok()
        && let Some(rejected) = &settings.rejected_dyn_log
    {
        tracing::warn!(dyn_log = %rejected, filter = %settings.filter, "DYN_LOG does not parse; using the next filter");
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> LogSettings {
        let env: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        LogSettings::from_lookup(|name| env.get(name).cloned())
    }

    #[test]
    fn dyn_log_wins_over_rust_log_and_info_is_the_default() {
        let both = settings(&[("DYN_LOG", "debug"), ("RUST_LOG", "warn")]);
        assert_eq!((both.filter.as_str(), both.source), ("debug", FilterSource::DynLog));
        let rust = settings(&[("RUST_LOG", "warn,kvrelay=trace")]);
        assert_eq!(
            (rust.filter.as_str(), rust.source),
            ("warn,kvrelay=trace", FilterSource::RustLog)
        );
        let none = settings(&[("DYN_LOG", " ")]);
        assert_eq!((none.filter.as_str(), none.source), ("info", FilterSource::Default));
    }

    #[test]
    fn an_unparsable_dyn_log_falls_back_and_is_reported() {
        let bad = settings(&[("DYN_LOG", "kvrelay=loud"), ("RUST_LOG", "warn")]);
        assert_eq!((bad.filter.as_str(), bad.source), ("warn", FilterSource::RustLog));
        assert_eq!(bad.rejected_dyn_log.as_deref(), Some("kvrelay=loud"));
    }

    #[test]
    fn jsonl_is_opt_in_and_never_coloured() {
        for yes in ["1", "true", " YES ", "on"] {
            assert!(settings(&[("DYN_LOGGING_JSONL", yes)]).jsonl, "{yes:?}");
        }
        for no in ["0", "false", "off", "", "maybe"] {
            assert!(!settings(&[("DYN_LOGGING_JSONL", no)]).jsonl, "{no:?}");
        }
        let json = settings(&[("DYN_LOGGING_JSONL", "1")]);
        assert!(!json.ansi(true));
        let text = settings(&[]);
        assert!(text.ansi(true));
        assert!(!text.ansi(false), "no colour off a terminal");
    }
}

//! What this build is: the package version and the source revision (`git rev-parse --short
//! HEAD` at build time, `unknown` without git), for every binary's `--version` and the
//! `kvrelay_build_info` metric.

/// The package version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The source revision the build was made from, or `unknown`.
pub const REVISION: &str = env!("KVRELAY_GIT_REVISION");

/// `--version`'s text after the program name: `<version> (rev <revision>)`.
pub const VERSION_LINE: &str =
    concat!(env!("CARGO_PKG_VERSION"), " (rev ", env!("KVRELAY_GIT_REVISION"), ")");

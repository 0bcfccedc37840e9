//! kvrelay: the relay's shell around `kvrelay-core`.
//!
//! The core decides; this crate moves inputs in and effects out: the production transports
//! (`discovery_plane`, `event_plane`, `request_plane`), the node task that drives the core's
//! relay (control plane and pool machines, `node`), what the shell keeps beside each pool and
//! the publication hubs (`pool`, `publication`), the tonic WAN service (`wan`), the input journal (`journal`), `serve`'s wiring with its
//! operations surface (`serve`, `ops`), the in-process `demo`, and configuration (`config`).
//! Time and blocking work enter through the `runtime` seams.

pub mod build_info;
pub mod config;
pub mod demo;
pub mod discovery_plane;
pub mod event_plane;
pub mod journal;
pub mod logging;
pub mod node;
pub mod ops;
pub mod pool;
pub mod publication;
pub mod request_plane;
pub mod runtime;
pub mod screen;
pub mod serve;
#[cfg(test)]
mod test_pki;
pub mod wan;

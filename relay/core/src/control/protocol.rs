//! What crosses the control plane's boundary besides [`DcInput`](crate::inputs::DcInput)s:
//! the shell's reports going in, the commands coming out, and the counters and health the plane
//! exposes. The protocol itself is described on [`ControlPlane`](super::ControlPlane)'s module.

use serde::Serialize;

use crate::host::{HostCommand, HostHealth, PoolFaultReport};
use crate::model::identity::{EndpointPath, PoolId};
use crate::pool::PoolFault;
use crate::sources::{RecoveryFailure, RecoveryRequestId, RecoveryResponse, SourceCommand};

/// An outcome the async shell reports back: the result of a command it carried out, or a fact
/// about the processes it runs. Reports naming a generation that is no longer starting or
/// active are ignored (and counted in [`ControlCounters::shell_reports_stale`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShellReport {
    /// A `StartPool` finished: the generation's pool runs.
    StartSucceeded {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The started generation.
        layout_generation: u64,
    },
    /// A `StartPool` failed: nothing of the generation runs.
    StartFailed {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The failed generation.
        layout_generation: u64,
    },
    /// A recovery query of a `Source` command was answered.
    RecoveryAnswered {
        /// The endpoint of the command.
        endpoint: EndpointPath,
        /// The generation of the command.
        layout_generation: u64,
        /// The call's correlation id.
        request_id: RecoveryRequestId,
        /// The worker's answer.
        response: RecoveryResponse,
    },
    /// A recovery query could not be delivered, or its call failed in transport.
    RecoveryUnreachable {
        /// The endpoint of the command.
        endpoint: EndpointPath,
        /// The generation of the command.
        layout_generation: u64,
        /// The call's correlation id.
        request_id: RecoveryRequestId,
        /// What failed.
        failure: RecoveryFailure,
    },
    /// A pool reported a failed write ([`PoolEffect::Fault`](crate::pool::PoolEffect)).
    /// It reaches the rank's tracker as [`ShellReport::ApplyFailed`] and the host's fault
    /// coalescing as [`ShellReport::PoolFaultReport`], both under the fence the failed command
    /// carried.
    PoolFault {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The generation whose pool reported it.
        layout_generation: u64,
        /// The fault.
        fault: PoolFault,
    },
    /// The pool refused a write of a rank that reaches only the rank's tracker: a rank
    /// replacement the pool answered with a refusal
    /// ([`PoolMachine::replace_ranks`](crate::pool::PoolMachine::replace_ranks)).
    ApplyFailed {
        /// The endpoint of the command.
        endpoint: EndpointPath,
        /// The generation of the command.
        layout_generation: u64,
        /// The refusal, under the fence the refused command carried.
        fault: PoolFault,
    },
    /// The generation's pool reported a fault for the host to coalesce.
    PoolFaultReport {
        /// The endpoint.
        endpoint: EndpointPath,
        /// The generation.
        layout_generation: u64,
        /// The fault.
        fault: PoolFaultReport,
    },
    /// A terminal publication failure of a generation.
    GenerationFenced {
        /// The pool.
        pool_id: PoolId,
        /// The generation.
        layout_generation: u64,
    },
    /// The generation's `kv_metrics` subscription errored or closed: after the gap, the old
    /// occupancy values prove nothing and are dropped.
    LoadStreamInterrupted {
        /// The serving endpoint.
        endpoint: EndpointPath,
        /// The generation whose load collector saw the interruption.
        layout_generation: u64,
    },
}

/// A command for the shell. Execute in order, each finished before the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlCommand {
    /// A command of the endpoint host (see [`HostCommand`]).
    Host(HostCommand),
    /// A source command for one active pool generation (see [`SourceCommand`]).
    Source {
        /// The serving endpoint of the pool.
        endpoint: EndpointPath,
        /// The pool.
        pool_id: PoolId,
        /// The generation whose pool the command is for.
        layout_generation: u64,
        /// The command.
        command: SourceCommand,
    },
    /// Publish the readiness topology at `revision` ([`ControlPlane::topology_snapshot`](super::ControlPlane::topology_snapshot)).
    PublishTopology {
        /// The new topology revision.
        revision: u64,
    },
}

/// Running totals of inputs that changed nothing, were refused or could not be routed, and of
/// routed traffic. Every field only grows (saturating).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct ControlCounters {
    /// Every `DcInput` handled.
    pub inputs: u64,
    /// Card inputs that changed nothing: out of scope, unknown id, or identical to what is held.
    pub card_inputs_without_effect: u64,
    /// Instance listings identical to the endpoint's latest one.
    pub instance_listings_unchanged: u64,
    /// Instance listings refused at [`INSTANCE_LISTINGS_MAX`](super::INSTANCE_LISTINGS_MAX).
    pub instance_listings_refused: u64,
    /// Listings dropped because they became empty for an endpoint no card serves (or the card
    /// went while its listing was empty).
    pub instance_listings_pruned: u64,
    /// Advertisements of a new publisher incarnation.
    pub adverts_added: u64,
    /// Advertisements identical to one already held.
    pub adverts_repeated: u64,
    /// Advertisements reusing a publisher id with another descriptor (the ranks they name
    /// become ambiguous).
    pub adverts_conflicting: u64,
    /// Advertisements refused because the table is full.
    pub adverts_refused: u64,
    /// Withdrawals of an advertisement that is not held.
    pub withdrawals_unknown: u64,
    /// KV event batches handed to at least one tracker.
    pub kv_batches_routed: u64,
    /// KV event batches whose endpoint scope is no active pool's KV-state endpoint.
    pub kv_batches_unrouted: u64,
    /// Load reports recorded as a rank's latest occupancy.
    pub load_reports_recorded: u64,
    /// Load reports without `kv_used_blocks` (router scheduler reports): accepted, ignored.
    pub load_reports_advisory: u64,
    /// Load reports for a rank the pool does not expect.
    pub load_reports_unknown_rank: u64,
    /// Load reports for an endpoint without an active pool.
    pub load_reports_unrouted: u64,
    /// Worker reports kept while no pool expected their rank, recorded once one did.
    pub early_load_reports_recorded: u64,
    /// Worker reports kept while no pool expected their rank, forgotten to keep the bound.
    pub early_load_reports_forgotten: u64,
    /// Capacity updates the load projection rejected (the pool's load is then degraded).
    pub capacity_updates_rejected: u64,
    /// Shell reports naming a generation that is no longer starting or active.
    pub shell_reports_stale: u64,
    /// `kv_metrics` interruptions that dropped a pool's observations.
    pub load_streams_interrupted: u64,
}

/// The plane's health summary (relay-facts §13, host part plus the plane's own checks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ControlHealth {
    /// The host is healthy and no plane invariant failed.
    pub healthy: bool,
    /// The endpoint host's summary.
    pub host: HostHealth,
    /// The last invariant failure of the plane, if any (a bug; it keeps the plane unhealthy).
    pub control_last_error: Option<String>,
    /// Current catalog revision.
    pub catalog_revision: u64,
    /// Current topology revision.
    pub topology_revision: u64,
    /// Active (cataloged) pools.
    pub pool_count: usize,
    /// Active pools whose load coverage is degraded.
    pub degraded_load_coverage_pool_count: usize,
    /// Input counters.
    pub counters: ControlCounters,
}

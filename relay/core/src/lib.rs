//! kvrelay-core: every decision the relay makes, with no async runtime, no network crate, no
//! clock and no ambient randomness (the crate's dependency tree is the proof: see `cargo tree
//! -p kvrelay-core -e normal`).
//!
//! Data flows top to bottom, in the order the modules are declared:
//!
//! - [`model`]: identity, Dynamo's block hashes and KV event values, shared by everything below;
//! - [`inputs`]: the one boundary of typed DC facts and every decoder of the deployment's wire
//!   formats (card JSON, discovery records, MessagePack envelopes);
//! - [`discovery`]: cards → endpoint memberships;
//! - [`sources`]: KV event source membership, per-rank cursors, gaps, recovery, source epochs;
//! - [`host`]: one slot per endpoint, materialization, the catalog, fault coalescing;
//! - [`pool`]: exact block ownership and the publisher that numbers publication batches;
//! - [`filter`]: the cuckoo filter, its CBI1 wire frames and the replica that applies them;
//! - [`readiness`]: serving readiness per `(namespace, model)` and its topology projection;
//! - [`load`]: pool KV occupancy windows with rank coverage;
//! - [`control`]: the composition of the above into one state machine;
//! - [`relay`]: the control plane and the running pool machines as one state machine;
//! - [`wire`]: the mapping to and from the `dynamo.kvrelay.v1` messages.
//!
//! Time enters as `now` arguments and randomness as an explicitly seeded [`rng::RelayRng`].

pub mod model;

pub mod inputs;

pub mod discovery;
pub mod sources;

pub mod host;
pub mod pool;

pub mod filter;

pub mod load;
pub mod readiness;

pub mod control;
pub mod relay;
pub mod rng;
pub mod wire;

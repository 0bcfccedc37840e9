//! The one boundary through which the relay learns about its data center.
//!
//! Every fact arrives as a typed [`DcInput`] value, whatever transport carried it (file or etcd
//! discovery, NATS or ZMQ event planes, the simulator, a replayed journal). Decoders of the
//! deployment's wire formats turn bytes into these facts; everything downstream consumes only
//! the facts, which is what makes recording and deterministic replay possible.

mod facts;

pub use facts::{
    CardInstanceId, DcInput, EndpointInstances, KvEventBatch, KvEventSourceAdvert, LoadObservation,
    LoraInfo, ModelCard, ModelInput, ModelTypeFlags, RecoveryTarget, RequestPlaneTransport,
    RuntimeConfig, WorkerType,
};

//! gRPC messages as tonic hands them over (protobuf-decoded from untrusted bytes), through the
//! relay's validation: every server-side request, and every update a consumer validates.
//!
//! Input: a selector byte naming the message type, then its protobuf encoding.
#![no_main]

use kvrelay_core::wire::{
    validate_catalog_request, validate_catalog_update, validate_descriptor, validate_filter_update,
    validate_load_request, validate_load_update, validate_pool_request, validate_readiness_request,
    validate_readiness_update, validate_relay_info, validate_relay_info_request,
    validate_topology_entry,
};
use kvrelay_proto::v1 as proto;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn run<M: Message + Default, R>(bytes: &[u8], validate: impl FnOnce(&M) -> R) {
    if let Ok(message) = M::decode(bytes) {
        let _ = validate(&message);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else { return };
    match selector % 12 {
        0 => run::<proto::RelayInfoRequest, _>(bytes, validate_relay_info_request),
        1 => run::<proto::WatchKvPoolCatalogRequest, _>(bytes, validate_catalog_request),
        2 => run::<proto::SubscribeServingReadinessRequest, _>(bytes, validate_readiness_request),
        3 => run::<proto::SubscribeKvPoolLoadRequest, _>(bytes, validate_load_request),
        4 => run::<proto::SubscribeKvPoolRequest, _>(bytes, validate_pool_request),
        5 => run::<proto::RelayInfo, _>(bytes, validate_relay_info),
        6 => run::<proto::KvPoolCatalogUpdate, _>(bytes, validate_catalog_update),
        7 => run::<proto::ServingReadinessUpdate, _>(bytes, validate_readiness_update),
        8 => run::<proto::KvPoolLoadUpdate, _>(bytes, validate_load_update),
        9 => run::<proto::FilterUpdate, _>(bytes, |update| validate_filter_update(update).is_ok()),
        10 => run::<proto::KvPoolDescriptor, _>(bytes, validate_descriptor),
        _ => run::<proto::TopologyEntry, _>(bytes, validate_topology_entry),
    }
});

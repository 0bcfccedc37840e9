//! The `dynamo.kvrelay.v1` wire contract: messages and enums, and with the `grpc`
//! feature the `KvEventRelay` service stubs.
//!
//! Generated from `proto/dynamo/kvrelay/v1/relay.proto`, which was written from the public
//! contract's message and field tables. Field numbers and enum values are frozen by v1.

#![allow(missing_docs, clippy::doc_lazy_continuation, clippy::large_enum_variant)]

/// The generated v1 package.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/dynamo.kvrelay.v1.rs"));
}

/// The stubs' codec.
#[cfg(feature = "grpc")]
pub mod codec;

/// The encoded `FileDescriptorSet` of the contract, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvrelay_v1_descriptor.bin"));

/// `"KVR1"` as a little-endian `fixed32`: carried in field 127 of every top-level message.
pub const CONTRACT_MARKER: u32 = 0x4B56_5231;

/// The compatibility major of the contract.
pub const PROTOCOL_VERSION: u32 = 1;

/// Trailing metadata key carrying a `RelayErrorReason` name.
pub const ERROR_REASON_METADATA_KEY: &str = "kv-relay-error-reason";

/// The fully qualified service name.
pub const SERVICE_NAME: &str = "dynamo.kvrelay.v1.KvEventRelay";

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::v1::*;
    use super::*;

    #[test]
    fn contract_marker_is_kvr1_in_field_127() {
        assert_eq!(CONTRACT_MARKER, 1_263_948_337);
        let bytes = RelayInfoRequest { contract_marker: CONTRACT_MARKER }.encode_to_vec();
        // Field 127, wire type 5 (fixed32): tag varint (127 << 3 | 5) = 0x3fd -> fd 07.
        assert_eq!(bytes, [0xfd, 0x07, 0x31, 0x52, 0x56, 0x4b]);
    }

    #[test]
    fn filter_payloads_are_shared_bytes() {
        let payload = bytes::Bytes::from_static(b"CBI1");
        let update = FilterUpdate { payload: payload.clone(), ..FilterUpdate::default() };
        assert_eq!(update.payload.as_ptr(), payload.as_ptr(), "no copy");
    }

    #[test]
    fn enum_names_match_the_contract() {
        assert_eq!(
            RelayErrorReason::ProducerChanged.as_str_name(),
            "RELAY_ERROR_REASON_PRODUCER_CHANGED"
        );
        assert_eq!(RelayErrorReason::Internal as i32, 11);
        assert_eq!(ServingReadinessState::Unknown as i32, 0);
        assert_eq!(WorkerRole::Legacy as i32, 5);
        assert_eq!(KvQueryHashFormat::DynamoEagleV1 as i32, 2);
        assert_eq!(FilterUpdateKind::Heartbeat as i32, 3);
        assert_eq!(IdentitySource::Explicit as i32, 2);
    }

    #[test]
    fn descriptor_set_names_one_file_with_28_messages_and_6_enums() {
        let set = prost_types_free_decode(FILE_DESCRIPTOR_SET);
        assert_eq!(set, (28, 6));
    }

    /// Count top-level messages and enums of the single file in an encoded descriptor set,
    /// reading the protobuf wire format directly (no prost-types dependency needed).
    fn prost_types_free_decode(bytes: &[u8]) -> (usize, usize) {
        fn varint(bytes: &[u8], at: &mut usize) -> u64 {
            let mut value = 0u64;
            let mut shift = 0;
            loop {
                let byte = bytes[*at];
                *at += 1;
                value |= u64::from(byte & 0x7f) << shift;
                if byte & 0x80 == 0 {
                    return value;
                }
                shift += 7;
            }
        }
        fn fields(bytes: &[u8]) -> Vec<(u64, &[u8])> {
            let mut out = Vec::new();
            let mut at = 0;
            while at < bytes.len() {
                let key = varint(bytes, &mut at);
                match key & 7 {
                    0 => {
                        varint(bytes, &mut at);
                    }
                    2 => {
                        let len = varint(bytes, &mut at) as usize;
                        out.push((key >> 3, &bytes[at..at + len]));
                        at += len;
                    }
                    5 => at += 4,
                    1 => at += 8,
                    other => panic!("unexpected wire type {other}"),
                }
            }
            out
        }
        let files: Vec<_> = fields(bytes).into_iter().filter(|(f, _)| *f == 1).collect();
        assert_eq!(files.len(), 1);
        let file = fields(files[0].1);
        let package = file.iter().find(|(f, _)| *f == 2).expect("package");
        assert_eq!(package.1, b"dynamo.kvrelay.v1");
        let messages = file.iter().filter(|(f, _)| *f == 4).count();
        let enums = file.iter().filter(|(f, _)| *f == 5).count();
        (messages, enums)
    }
}

//! Compile the v1 contract with protox (pure Rust, no system protoc) and keep the encoded file
//! descriptor set for gRPC reflection.

use std::path::PathBuf;

use prost::Message;

fn main() {
    let proto = "proto/dynamo/kvrelay/v1/relay.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"]).expect("relay.proto compiles");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out_dir.join("kvrelay_v1_descriptor.bin"), descriptors.encode_to_vec())
        .expect("descriptor set written");
    // CBI1 payloads are shared by every subscriber of a pool: `Bytes` makes that a refcount.
    // Service stubs only with the `grpc` feature: the relay's core uses the messages alone.
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    tonic_prost_build::configure()
        .build_client(grpc)
        .build_server(grpc)
        .bytes(".dynamo.kvrelay.v1.FilterUpdate.payload")
        // Each message reserved whole before it is encoded (`src/codec.rs`).
        .codec_path("crate::codec::ExactCodec")
        .compile_fds(descriptors)
        .expect("code generation succeeds");
}

//! Generate the etcd v3 client subset (`proto/etcd/kv_watch.proto`) with protox: pure Rust, no
//! system protoc. Only client stubs are generated; the relay never serves etcd's API.

fn main() {
    let proto = "proto/etcd/kv_watch.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"]).expect("kv_watch.proto compiles");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)
        .expect("etcd client code generation succeeds");
}

//! Generate the etcd v3 client subset (`proto/etcd/kv_watch.proto`, `proto/etcd/auth.proto`)
//! with protox: pure Rust, no system protoc. Only client stubs are generated; the relay never
//! serves etcd's API.

fn main() {
    let protos = ["proto/etcd/kv_watch.proto", "proto/etcd/auth.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"]).expect("the etcd protos compile");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)
        .expect("etcd client code generation succeeds");
}

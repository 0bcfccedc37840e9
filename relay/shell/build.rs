//! Generate the etcd v3 client subset (`proto/etcd/kv_watch.proto`, `proto/etcd/auth.proto`)
//! with protox: pure Rust, no system protoc. Only client stubs are generated; the relay never
//! serves etcd's API.
//!
//! Also record the source revision for `--version` and the `kvrelay_build_info` metric:
//! `KVRELAY_GIT_REVISION` is `git rev-parse --short HEAD`, or `unknown` where there is no git
//! or no repository. The script reruns when HEAD moves (the HEAD file and the ref it names).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

fn record_revision() {
    let revision = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=KVRELAY_GIT_REVISION={revision}");
    // `--git-path` resolves the files of a worktree as well as those of a plain checkout.
    if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={head}");
    }
    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(path) = git(&["rev-parse", "--git-path", &reference])
    {
        println!("cargo:rerun-if-changed={path}");
    }
}

fn main() {
    let protos = ["proto/etcd/kv_watch.proto", "proto/etcd/auth.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    record_revision();
    let descriptors = protox::compile(protos, ["proto"]).expect("the etcd protos compile");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)
        .expect("etcd client code generation succeeds");
}

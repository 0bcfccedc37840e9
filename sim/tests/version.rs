//! `kvrelay-sim --version` names the package version and the source revision.

#[test]
fn the_simulator_prints_its_version_and_revision() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvrelay-sim"))
        .arg("--version")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
    let text = String::from_utf8(output.stdout).unwrap();
    assert_eq!(text.trim(), format!("kvrelay-sim {}", kvrelay::build_info::VERSION_LINE));
}

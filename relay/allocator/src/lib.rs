//! The system allocator's settings for a long-running relay process.
//!
//! glibc's malloc maps a block of at least its *mmap threshold* on its own and unmaps it when
//! the block is freed. By default the threshold is dynamic: each time a mapped block is freed,
//! glibc raises the threshold to that block's size (up to 32 MiB). After the relay's first
//! snapshot chunk (4 MiB of words) is freed, later chunks, recovery answers and wide NATS
//! messages therefore come from the heap, and what a burst freed there stays resident: the
//! process's memory ratchets up phase after phase. Pinning the threshold turns the dynamic
//! adjustment off, so blocks of [`MMAP_THRESHOLD_BYTES`] and more are always returned on free.
//!
//! An operator who sets glibc's own variable ([`THRESHOLD_ENV`]) keeps it: glibc applied it at
//! start-up and [`pin_mmap_threshold`] leaves it alone. On other C libraries this crate does
//! nothing.
//!
//! This crate and `kvrelay-prefetch` hold the workspace's only `unsafe` code. Here: one call
//! into the C library and one in the tests, each with its contract.

/// Blocks of at least this many bytes are mapped on their own and unmapped on free: glibc's
/// initial threshold, kept instead of raised.
pub const MMAP_THRESHOLD_BYTES: usize = 128 * 1024;

/// glibc's variable for the threshold; when it is set, the operator's value stands.
pub const THRESHOLD_ENV: &str = "MALLOC_MMAP_THRESHOLD_";

/// What [`pin_mmap_threshold`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmapThreshold {
    /// Pinned at this many bytes.
    Pinned(usize),
    /// The operator set [`THRESHOLD_ENV`]; glibc applied it at start-up and it stands.
    FromEnvironment,
    /// glibc refused the setting; the dynamic threshold stays.
    Refused,
    /// Not glibc: nothing to pin.
    Unsupported,
}

/// Pin glibc's mmap threshold at [`MMAP_THRESHOLD_BYTES`] unless the operator set
/// [`THRESHOLD_ENV`] (`env_set`). Call once, early in `main`; later calls are harmless.
#[must_use]
pub fn pin_mmap_threshold(env_set: bool) -> MmapThreshold {
    if env_set {
        return MmapThreshold::FromEnvironment;
    }
    pin(MMAP_THRESHOLD_BYTES)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn pin(bytes: usize) -> MmapThreshold {
    let Ok(value) = libc::c_int::try_from(bytes) else {
        return MmapThreshold::Refused;
    };
    // SAFETY: `mallopt` only changes a malloc parameter under malloc's own lock; it takes no
    // pointer and is safe to call from any thread at any time. It returns 1 on success and 0
    // when the value is out of range.
    #[allow(unsafe_code)]
    let accepted = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, value) };
    if accepted == 1 { MmapThreshold::Pinned(bytes) } else { MmapThreshold::Refused }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn pin(_bytes: usize) -> MmapThreshold {
    MmapThreshold::Unsupported
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use std::process::Command;

    /// Selects what the probe test does in a child process: `pinned`, `dynamic` or `env`.
    const PROBE_ENV: &str = "KVRELAY_ALLOCATOR_PROBE";

    /// Bytes glibc holds in mapped blocks.
    fn mapped_bytes() -> usize {
        // SAFETY: `mallinfo2` takes no argument, reads malloc's statistics under its lock and
        // returns them by value.
        #[allow(unsafe_code)]
        let info = unsafe { libc::mallinfo2() };
        info.hblkhd
    }

    /// Whether a fresh block of `bytes` is mapped on its own (glibc's mapped bytes grow by at
    /// least its size while it lives).
    fn is_mapped(bytes: usize) -> bool {
        let before = mapped_bytes();
        let block = std::hint::black_box(vec![1u8; bytes]);
        let grew = mapped_bytes().saturating_sub(before);
        drop(block);
        grew >= bytes
    }

    /// Run in a child process (the threshold is process-wide and cannot be unpinned): free one
    /// mapped 4 MiB block, which raises a dynamic threshold past 1 MiB, then report whether a
    /// 1 MiB block is still mapped.
    #[test]
    #[ignore = "the child process of the tests below, which run it with --ignored"]
    fn probe() {
        let mode = std::env::var(PROBE_ENV).expect("run by the probe tests, with their mode");
        match mode.as_str() {
            "pinned" => {
                assert_eq!(pin_mmap_threshold(false), MmapThreshold::Pinned(MMAP_THRESHOLD_BYTES))
            }
            "env" => assert_eq!(pin_mmap_threshold(true), MmapThreshold::FromEnvironment),
            // The control: glibc's default, dynamic threshold.
            _ => {}
        }
        let burst_mapped = is_mapped(4 << 20);
        if mode != "env" {
            assert!(burst_mapped, "under glibc's initial threshold a 4 MiB block is mapped");
        }
        println!("PROBE mapped_after_burst={}", is_mapped(1 << 20));
    }

    fn run_probe(mode: &str, threshold_env: Option<&str>) -> bool {
        let exe = std::env::current_exe().expect("the test binary");
        let mut command = Command::new(exe);
        command.args(["--exact", "tests::probe", "--ignored", "--nocapture", "--test-threads=1"]);
        command.env(PROBE_ENV, mode).env_remove(THRESHOLD_ENV);
        if let Some(value) = threshold_env {
            command.env(THRESHOLD_ENV, value);
        }
        let output = command.output().expect("run the probe");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "probe {mode} failed: {stdout}");
        let line = stdout.lines().find(|line| line.contains("PROBE ")).expect("probe output");
        line.contains("mapped_after_burst=true")
    }

    #[test]
    fn a_pinned_threshold_keeps_returning_large_blocks_after_a_burst() {
        assert!(run_probe("pinned", None), "pinned: a 1 MiB block after a 4 MiB one is mapped");
    }

    #[test]
    fn without_the_pin_glibc_serves_the_next_large_block_from_its_heap() {
        // The control that shows the probe can fail: the dynamic threshold rose past 1 MiB.
        assert!(!run_probe("dynamic", None), "dynamic: the 1 MiB block came from the heap");
    }

    #[test]
    fn the_operators_threshold_stands() {
        // A threshold above 1 MiB set by the operator is not overridden by the pin.
        assert!(!run_probe("env", Some("8388608")), "env: 8 MiB threshold keeps 1 MiB in the heap");
        assert!(run_probe("env", Some("131072")), "env: 128 KiB threshold maps 1 MiB");
    }
}

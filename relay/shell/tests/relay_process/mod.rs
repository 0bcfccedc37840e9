//! The built `kvrelay serve` as a child process on loopback ports: file discovery in a
//! directory the test chooses, the ZMQ event plane (no server needed), and helpers to wait for
//! its listeners, read its RSS and send it SIGTERM. The child is killed by PID when dropped.

#![allow(dead_code, reason = "each test binary uses part of the helpers")]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

/// A free loopback port (bound and released; the relay binds it next).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A running `kvrelay serve`.
pub struct RelayProcess {
    /// The child.
    pub child: Child,
    /// Its WAN listener.
    pub wan: SocketAddr,
    /// Its operations listener.
    pub ops: SocketAddr,
}

impl RelayProcess {
    /// Start `kvrelay serve` with file discovery under `discovery_root` and `env` added.
    pub fn spawn(discovery_root: &Path, env: &[(&str, &str)]) -> RelayProcess {
        let wan: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let ops: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvrelay"));
        command
            .args(["serve", "--dc-id", "dc-a", "--watch-all"])
            .args(["--bind", &wan.to_string(), "--ops-bind", &ops.to_string()])
            .env("DYN_DISCOVERY_BACKEND", "file")
            .env("DYN_FILE_KV", discovery_root)
            .env("DYN_EVENT_PLANE", "zmq")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        for (name, value) in env {
            command.env(name, value);
        }
        RelayProcess { child: command.spawn().unwrap(), wan, ops }
    }

    /// Wait (at most 10 s) until both listeners accept connections.
    pub async fn wait_listening(&self) {
        for address in [self.wan, self.ops] {
            let mut listening = false;
            for _ in 0..200 {
                if tokio::net::TcpStream::connect(address).await.is_ok() {
                    listening = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(listening, "the relay never listened on {address}");
        }
    }

    /// The child's resident set in KiB (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> u64 {
        rss_kib_of(&format!("/proc/{}/status", self.child.id()))
    }

    /// Send SIGTERM.
    pub fn terminate(&self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    }

    /// Wait at most `bound` for the child to exit; its status and how long it took.
    pub async fn wait_exit(&mut self, bound: Duration) -> Option<(ExitStatus, Duration)> {
        let start = Instant::now();
        while start.elapsed() < bound {
            if let Some(exit) = self.child.try_wait().unwrap() {
                return Some((exit, start.elapsed()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `VmRSS` in KiB from a `/proc/.../status` file (0 if unreadable).
pub fn rss_kib_of(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|status| {
            status.lines().find(|line| line.starts_with("VmRSS:")).and_then(|line| {
                line.split_whitespace().nth(1).and_then(|kib| kib.parse::<u64>().ok())
            })
        })
        .unwrap_or(0)
}

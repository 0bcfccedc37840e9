//! Real servers for the tests that need them: Debian's `nats-server` and `etcd` (installed by
//! `.ci/run`), started on 127.0.0.1 with free ports and killed by PID when dropped, also when a
//! test fails.
#![allow(dead_code, reason = "each test binary that includes this module uses a part of it")]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvrelay::discovery_plane::{EtcdClient, EtcdConnectOptions};

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Connection options for a local test etcd: short timeouts.
pub fn etcd_options() -> EtcdConnectOptions {
    EtcdConnectOptions {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        ..EtcdConnectOptions::default()
    }
}

/// A `nats-server` child process on 127.0.0.1, killed by PID when dropped.
pub struct NatsServer {
    child: Child,
    port: u16,
    /// The configuration file's directory, when the server was started with one.
    _config: Option<tempfile::TempDir>,
}

/// Start `nats-server` with `args`, which make it listen on 127.0.0.1:`port`, and wait until it
/// does. Debian installs the server in /usr/sbin, which a non-root PATH may lack.
pub async fn spawn_nats(port: u16, args: &[&str]) -> Child {
    let mut spawned = Err(std::io::Error::other("no candidate"));
    for program in ["nats-server", "/usr/sbin/nats-server", "/usr/bin/nats-server"] {
        spawned = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        if spawned.is_ok() {
            break;
        }
    }
    let mut child = spawned.unwrap_or_else(|error| {
        panic!(
            "cannot start `nats-server` ({error}): install it with \
             `apt-get update && apt-get install -y nats-server` (.ci/run does this)"
        )
    });
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return child;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("nats-server did not listen on 127.0.0.1:{port} within 10 s");
}

impl NatsServer {
    /// Start on a free port.
    pub async fn start() -> Self {
        Self::start_on(free_port()).await
    }

    /// Start on `port` (a restart of a server keeps its port); wait until it listens.
    pub async fn start_on(port: u16) -> Self {
        let child = spawn_nats(port, &["-a", "127.0.0.1", "-p", &port.to_string()]).await;
        NatsServer { child, port, _config: None }
    }

    /// Start on `port` with a configured `max_payload` (set through a configuration file: the
    /// server has no flag for it).
    pub async fn start_with_max_payload(port: u16, max_payload: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("nats.conf");
        std::fs::write(&file, format!("max_payload: {max_payload}\n")).unwrap();
        let file = file.to_str().unwrap().to_owned();
        let port_text = port.to_string();
        let child = spawn_nats(port, &["-c", &file, "-a", "127.0.0.1", "-p", &port_text]).await;
        NatsServer { child, port, _config: Some(dir) }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The etcd binary on `PATH`; the etcd tests fail (not skip) without it.
fn etcd_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("etcd"))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "the `etcd` binary is not installed, and the etcd discovery tests need it: \
                 run `apt-get update && apt-get install -y etcd-server`"
            )
        })
}

/// A real etcd on 127.0.0.1 with a temporary data dir; killed (by its PID) when dropped, also
/// when the test fails.
pub struct EtcdProcess {
    binary: PathBuf,
    dir: tempfile::TempDir,
    peer_port: u16,
    /// The port etcd serves clients on (after [`EtcdProcess::start`]).
    pub client_port: u16,
    child: Option<Child>,
    /// `http`, or `https` for [`EtcdProcess::start_tls`].
    scheme: &'static str,
    /// Arguments added to every start (TLS files).
    extra_args: Vec<String>,
    /// How the readiness probe connects.
    probe: EtcdConnectOptions,
}

impl EtcdProcess {
    pub async fn start() -> Self {
        Self::start_with("http", Vec::new(), etcd_options()).await
    }

    /// Serve clients over TLS with `cert`/`key`, requiring client certificates signed by `ca`
    /// (`--client-cert-auth`); `probe` must carry a client certificate.
    pub async fn start_tls(
        ca: &std::path::Path,
        cert: &std::path::Path,
        key: &std::path::Path,
        probe: EtcdConnectOptions,
    ) -> Self {
        let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
        let args = vec![
            "--client-cert-auth".to_owned(),
            "--trusted-ca-file".to_owned(),
            path(ca),
            "--cert-file".to_owned(),
            path(cert),
            "--key-file".to_owned(),
            path(key),
        ];
        Self::start_with("https", args, probe).await
    }

    async fn start_with(
        scheme: &'static str,
        extra_args: Vec<String>,
        probe: EtcdConnectOptions,
    ) -> Self {
        let mut etcd = EtcdProcess {
            binary: etcd_binary(),
            dir: tempfile::tempdir().unwrap(),
            peer_port: free_port(),
            client_port: free_port(),
            child: None,
            scheme,
            extra_args,
            probe,
        };
        etcd.spawn(etcd.client_port).await;
        etcd
    }

    pub fn url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.client_port)
    }

    /// Start etcd on the same data dir, serving clients on `client_port`; wait until it answers.
    pub async fn spawn(&mut self, client_port: u16) {
        assert!(self.child.is_none(), "etcd is already running");
        let client = format!("{}://127.0.0.1:{client_port}", self.scheme);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .unwrap();
        let child = Command::new(&self.binary)
            .args(["--name", "kvrelay-test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvrelay-test={peer}")])
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut probe) = EtcdClient::connect(&client, &self.probe).await
                && probe.range_prefix(b"v1/", 1, 1 << 16).await.is_ok()
            {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "etcd did not answer on {client} within 30 s; see {}",
                self.dir.path().join("etcd.log").display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

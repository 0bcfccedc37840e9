#!/usr/bin/env python3
"""Check scripts/tun-link.py on real packets: two private network namespaces joined by a TUN
link it carries, a TCP echo across it in every mode, and what each mode must do.

    scripts/tun-link-check.py          # ~15 s; exit 0 passed (or skipped), 1 failed

- pass: 1 MB echoed intact, median round trip under 50 ms;
- delay 50 10 (each way): intact, no round trip under 2 x 40 ms;
- loss 10: intact (TCP retransmits), and the link lost 3-25 % of the packets it carried then;
- reorder 20 25: intact, and the receiver's kernel queued out-of-order segments
  (TcpExtTCPOFOQueue of the namespace grows): packets really overtook each other;
- a2b rate 1000 (1 Mbit/s one way): 200 kB sent take at least 1.2 s;
- drop: a new connection cannot be made.

Skips (exit 0, saying why) without root, /dev/net/tun or `ip`, or where namespaces cannot be
made. Everything it starts it stops by PID, and it deletes its namespaces on any exit.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 7311


def client(address, payload_bytes, connect_timeout):
    """Round trips of 10 bytes, then an echo of `payload_bytes`; prints one JSON line."""
    try:
        conn = socket.create_connection((address, PORT), timeout=connect_timeout)
    except OSError as error:
        print(json.dumps({"connected": False, "error": str(error)}))
        return
    conn.settimeout(30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(10):
        started = time.monotonic()
        conn.sendall(b"x" * 10)
        got = b""
        while len(got) < 10:
            got += conn.recv(100)
        rtts.append((time.monotonic() - started) * 1000)
    payload = os.urandom(payload_bytes)
    echoed = bytearray()

    def read():
        while len(echoed) < len(payload):
            chunk = conn.recv(65536)
            if not chunk:
                return
            echoed.extend(chunk)

    reader = threading.Thread(target=read)
    started = time.monotonic()
    reader.start()
    conn.sendall(payload)
    reader.join()
    seconds = time.monotonic() - started
    rtts.sort()
    print(json.dumps({
        "connected": True,
        "rtt_min_ms": rtts[0],
        "rtt_median_ms": rtts[len(rtts) // 2],
        "seconds": seconds,
        "intact": bytes(echoed) == payload,
    }))


def server(address):
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, PORT))
    listener.listen()
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def echo(conn):
    with conn:
        while chunk := conn.recv(65536):
            conn.sendall(chunk)


class Run:
    def __init__(self):
        tag = f"tlc{os.getpid() % 100000}"
        self.ns = (f"{tag}a", f"{tag}b")
        octet = 100 + os.getpid() % 100
        self.addresses = (f"10.79.{octet}.1", f"10.79.{octet}.2")
        self.work = tempfile.mkdtemp(prefix="tun-link-check.")
        self.control = os.path.join(self.work, "link.ctl")
        self.log = os.path.join(self.work, "link.log")
        self.processes = []
        self.made = []
        self.failures = []

    def ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def setup(self):
        for name in self.ns:
            self.ip("netns", "add", name)
            self.made.append(name)
            self.ip("-n", name, "link", "set", "lo", "up")
        for name, device, address in zip(self.ns, ("tla", "tlb"), self.addresses):
            self.ip("-n", name, "tuntap", "add", "dev", device, "mode", "tun")
            self.ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            self.ip("-n", name, "link", "set", device, "up")
        with open(self.control, "w", encoding="utf-8") as file:
            file.write("both pass\n")
        self.link = self.start(
            [sys.executable, os.path.join(HERE, "tun-link.py"), "--a", f"{self.ns[0]}:tla",
             "--b", f"{self.ns[1]}:tlb", "--control", self.control, "--seed", "7"],
            open(self.log, "w", encoding="utf-8"),
        )
        self.wait_log(" up", 5)
        self.start(["ip", "netns", "exec", self.ns[1], sys.executable, __file__, "--server",
                    self.addresses[1]], subprocess.DEVNULL)
        time.sleep(0.5)

    def start(self, argv, output):
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    def wait_log(self, text, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with open(self.log, encoding="utf-8") as file:
                if any(line.rstrip().endswith(text) for line in file):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"tun-link never logged {text!r}: {open(self.log).read()}")

    def mode(self, spec):
        with open(self.control, "w", encoding="utf-8") as file:
            file.write(spec + "\n")
        self.link.send_signal(signal.SIGHUP)
        kind = spec.split()[1]
        self.wait_log_contains(kind, 5)

    def wait_log_contains(self, text, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with open(self.log, encoding="utf-8") as file:
                lines = file.read().splitlines()
            if lines and text in lines[-1]:
                return
            time.sleep(0.05)
        raise RuntimeError(f"tun-link did not apply {text!r}")

    def probe(self, payload_bytes, connect_timeout=5):
        result = subprocess.run(
            ["ip", "netns", "exec", self.ns[0], sys.executable, __file__, "--client",
             self.addresses[1], str(payload_bytes), str(connect_timeout)],
            capture_output=True, text=True, timeout=90, check=True,
        )
        return json.loads(result.stdout)

    def counters(self):
        """Both directions' counters, summed (SIGUSR1 makes the link print them)."""
        with open(self.log, encoding="utf-8") as file:
            lines_before = len(file.read().splitlines())
        self.link.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(self.log, encoding="utf-8") as file:
                lines = file.read().splitlines()[lines_before:]
            counts = [line for line in lines if " forwarded=" in line]
            if len(counts) >= 2:
                total = {}
                for line in counts[:2]:
                    for word in line.split()[2:]:
                        key, value = word.split("=")
                        total[key] = total.get(key, 0) + int(value)
                return total
            time.sleep(0.05)
        raise RuntimeError("tun-link printed no counters")

    def out_of_order(self):
        """TcpExtTCPOFOQueue of the receiving namespace (server side)."""
        text = subprocess.run(["ip", "netns", "exec", self.ns[1], "cat", "/proc/net/netstat"],
                              capture_output=True, text=True, check=True).stdout.splitlines()
        for names, values in zip(text[::2], text[1::2]):
            if names.startswith("TcpExt:"):
                return dict(zip(names.split()[1:], map(int, values.split()[1:])))["TCPOFOQueue"]
        raise RuntimeError("no TcpExt line in /proc/net/netstat")

    def expect(self, condition, what, result):
        verdict = "ok  " if condition else "FAIL"
        print(f"  {verdict} {what}: {result}", flush=True)
        if not condition:
            self.failures.append(what)

    def cleanup(self):
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for name in self.made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)


def check():
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun") or not shutil.which("ip"):
        print("tun-link check: skipped (needs root, /dev/net/tun and ip)")
        return 0
    run = Run()
    try:
        try:
            run.setup()
        except (subprocess.CalledProcessError, OSError) as error:
            detail = getattr(error, "stderr", "") or error
            print(f"tun-link check: skipped (cannot make namespaces and TUN devices: {detail})")
            return 0
        print(f"tun-link check: {run.ns[0]} {run.addresses[0]} <-> {run.ns[1]} {run.addresses[1]}")
        result = run.probe(1_000_000)
        run.expect(result["intact"] and result["rtt_median_ms"] < 50, "pass", result)
        run.mode("both delay 50 10")
        result = run.probe(200_000)
        run.expect(result["intact"] and result["rtt_min_ms"] >= 80, "delay 50 10", result)
        run.mode("both loss 10")
        before = run.counters()
        result = run.probe(300_000)
        after = run.counters()
        lost = after["lost"] - before["lost"]
        carried = lost + after["forwarded"] - before["forwarded"]
        share = lost / max(1, carried)
        run.expect(result["intact"] and 0.03 <= share <= 0.25,
                   f"loss 10 ({lost} of {carried} packets lost)", result)
        before = run.out_of_order()
        run.mode("both reorder 20 25")
        result = run.probe(1_000_000)
        grown = run.out_of_order() - before
        run.expect(result["intact"] and grown > 0, f"reorder 20 25 ({grown} segments queued "
                   "out of order)", result)
        run.mode("a2b rate 1000")
        result = run.probe(200_000)
        run.expect(result["intact"] and result["seconds"] >= 1.2, "a2b rate 1000", result)
        run.mode("both drop")
        result = run.probe(0, connect_timeout=2)
        run.expect(not result["connected"], "drop", result)
    finally:
        run.cleanup()
    if run.failures:
        print(f"tun-link check: {len(run.failures)} failed: {', '.join(run.failures)}")
        return 1
    print("tun-link check: passed")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--server":
        server(sys.argv[2])
    else:
        sys.exit(check())

#!/usr/bin/env python3
"""A point-to-point IP link between two network namespaces, carried packet by packet by this
process through one TUN device in each, with the impairments `tc netem` would make.

    tun-link.py --a NS_A:DEV_A --b NS_B:DEV_B --control FILE [--seed N]

Both devices must exist (`ip -n NS tuntap add dev DEV mode tun`, addressed and up); the process
attaches to them (it enters each namespace in turn through /run/netns/NS, which needs root) and
forwards every IP packet read from one to the other. Kernels without sch_netem (and machines
without nftables) can still lose, delay, reorder and throttle real packets this way: the TCP
stacks at both ends see exactly what they would on an impaired wire (segments missing, late,
out of order), unlike a TCP forwarder, which can only delay a byte stream.

On SIGHUP the process reads FILE: one line per direction, `DIR MODE [ARGS]`, DIR one of
`a2b`, `b2a`, `both`; the last line for a direction wins and a direction not named passes.

    pass                 forward at once
    drop                 every packet lost
    loss PERCENT         each packet lost with that probability
    delay MS JITTER      each packet held MS +- JITTER ms (uniform; jitter reorders, as netem's)
    reorder MS PERCENT   each packet held MS ms, but PERCENT % of them sent at once, so they
                         overtake the held ones (netem's `delay MS reorder PERCENT%`)
    rate KBIT            a token bucket of KBIT kbit/s with a FIFO queue of 256 KiB (tail drop)

Packets already held keep their release times when the mode changes. Bounds: at most 4,096
packets (and 8 MiB) held per direction, past which arrivals are dropped and counted. SIGUSR1
prints the counters; SIGTERM prints them and exits 0. Randomness comes from --seed, so a run's choices repeat.
"""

import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
PACKET_BYTES_MAX = 65_535
HELD_PACKETS_MAX = 4_096
HELD_BYTES_MAX = 8 << 20
RATE_QUEUE_BYTES_MAX = 256 << 10
POLL_MS_MAX = 50
DIRECTIONS = ("a2b", "b2a")

LIBC = ctypes.CDLL(None, use_errno=True)


def enter_namespace(name):
    """Move this (single-threaded) process into network namespace NAME."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if LIBC.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def attach(name):
    """A non-blocking file descriptor of TUN device NAME in the current namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    request = struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI)
    fcntl.ioctl(fd, TUNSETIFF, request)
    os.set_blocking(fd, False)
    return fd


def parse_mode(words):
    """A mode from its words, or raise ValueError with what is wrong."""
    kind, args = words[0], words[1:]
    arity = {"pass": 0, "drop": 0, "loss": 1, "delay": 2, "reorder": 2, "rate": 1}
    if kind not in arity:
        raise ValueError(f"unknown mode {kind!r}")
    if len(args) != arity[kind]:
        raise ValueError(f"{kind} takes {arity[kind]} argument(s), got {len(args)}")
    numbers = [float(arg) for arg in args]
    if any(number < 0 for number in numbers):
        raise ValueError(f"{kind}: negative argument")
    if kind in ("loss", "reorder") and numbers[-1] > 100:
        raise ValueError(f"{kind}: a percentage above 100")
    if kind == "rate" and numbers[0] == 0:
        raise ValueError("rate: 0 kbit/s")
    return (kind, *numbers)


def read_control(path):
    """Each direction's mode from the control file (ValueError names the bad line)."""
    modes = dict.fromkeys(DIRECTIONS, ("pass",))
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if words[0] not in (*DIRECTIONS, "both") or len(words) < 2:
                raise ValueError(f"{path}:{number}: expected DIR MODE [ARGS]")
            try:
                mode = parse_mode(words[1:])
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
            for direction in DIRECTIONS if words[0] == "both" else (words[0],):
                modes[direction] = mode
    return modes


class Direction:
    """One direction of the link: its mode, the packets it holds and its counters."""

    def __init__(self, name, out_fd, rng):
        self.name = name
        self.out_fd = out_fd
        self.rng = rng
        self.mode = ("pass",)
        self.held = []  # heap of (release time, arrival number, packet)
        self.held_bytes = 0
        self.arrivals = 0
        self.rate_free_at = 0.0  # when the token bucket's line is next idle
        self.counters = dict.fromkeys(
            ("forwarded", "lost", "held", "overflow", "write_dropped"), 0
        )

    def arrive(self, packet, now):
        """Apply the mode to one packet read from the other end."""
        self.arrivals += 1
        kind, *args = self.mode
        if kind == "pass":
            self.send(packet)
            return
        if kind == "drop" or (kind == "loss" and self.rng.random() * 100 < args[0]):
            self.counters["lost"] += 1
            return
        if kind == "loss":
            self.send(packet)
            return
        if kind == "delay":
            delay_ms = max(0.0, args[0] + self.rng.uniform(-args[1], args[1]))
            self.hold(packet, now + delay_ms / 1000)
        elif kind == "reorder":
            if self.rng.random() * 100 < args[1]:
                self.send(packet)
            else:
                self.hold(packet, now + args[0] / 1000)
        elif kind == "rate":
            queued = max(0.0, self.rate_free_at - now) * args[0] * 1000 / 8
            if queued + len(packet) > RATE_QUEUE_BYTES_MAX:
                self.counters["overflow"] += 1
                return
            start = max(now, self.rate_free_at)
            self.rate_free_at = start + len(packet) * 8 / (args[0] * 1000)
            self.hold(packet, self.rate_free_at)

    def hold(self, packet, release_at):
        if len(self.held) >= HELD_PACKETS_MAX or self.held_bytes + len(packet) > HELD_BYTES_MAX:
            self.counters["overflow"] += 1
            return
        self.counters["held"] += 1
        self.held_bytes += len(packet)
        heapq.heappush(self.held, (release_at, self.arrivals, packet))

    def release_due(self, now):
        while self.held and self.held[0][0] <= now:
            _, _, packet = heapq.heappop(self.held)
            self.held_bytes -= len(packet)
            self.send(packet)

    def next_release(self):
        return self.held[0][0] if self.held else None

    def send(self, packet):
        try:
            os.write(self.out_fd, packet)
            self.counters["forwarded"] += 1
        except (BlockingIOError, OSError):
            # A full device queue (or a device that is down) loses the packet, as a wire would.
            self.counters["write_dropped"] += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--a", required=True, metavar="NS:DEV")
    parser.add_argument("--b", required=True, metavar="NS:DEV")
    parser.add_argument("--control", required=True, metavar="FILE")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    ends = []
    for end in (options.a, options.b):
        namespace, _, device = end.partition(":")
        if not namespace or not device:
            parser.error(f"{end!r}: expected NS:DEV")
        enter_namespace(namespace)
        ends.append(attach(device))
    fd_a, fd_b = ends
    rng = random.Random(options.seed)
    directions = {
        fd_a: Direction("a2b", fd_b, random.Random(rng.getrandbits(64))),
        fd_b: Direction("b2a", fd_a, random.Random(rng.getrandbits(64))),
    }
    by_name = {direction.name: direction for direction in directions.values()}
    flags = {"reload": False, "stop": False, "report": False}
    signal.signal(signal.SIGHUP, lambda *_: flags.update(reload=True))
    signal.signal(signal.SIGUSR1, lambda *_: flags.update(report=True))
    signal.signal(signal.SIGTERM, lambda *_: flags.update(stop=True))
    signal.signal(signal.SIGINT, lambda *_: flags.update(stop=True))
    poller = select.poll()
    for fd in directions:
        poller.register(fd, select.POLLIN)
    print(f"tun-link: {options.a} <-> {options.b} up", file=sys.stderr, flush=True)
    while not flags["stop"]:
        if flags["report"]:
            flags["report"] = False
            report(directions.values())
        if flags["reload"]:
            flags["reload"] = False
            try:
                modes = read_control(options.control)
            except (OSError, ValueError) as error:
                print(f"tun-link: control not applied: {error}", file=sys.stderr, flush=True)
            else:
                for name, mode in modes.items():
                    by_name[name].mode = mode
                text = ", ".join(f"{name} {' '.join(map(str, mode))}" for name, mode in modes.items())
                print(f"tun-link: {text}", file=sys.stderr, flush=True)
        now = time.monotonic()
        releases = [d.next_release() for d in directions.values() if d.next_release() is not None]
        wait_ms = POLL_MS_MAX
        if releases:
            wait_ms = max(0, min(POLL_MS_MAX, int((min(releases) - now) * 1000) + 1))
        for fd, _ in poller.poll(wait_ms):
            direction = directions[fd]
            while True:
                try:
                    packet = os.read(fd, PACKET_BYTES_MAX)
                except BlockingIOError:
                    break
                if not packet:
                    break
                direction.arrive(packet, time.monotonic())
        now = time.monotonic()
        for direction in directions.values():
            direction.release_due(now)
    report(directions.values())


def report(directions):
    """One line of counters per direction, on stderr."""
    for direction in directions:
        counts = " ".join(f"{key}={value}" for key, value in direction.counters.items())
        print(f"tun-link: {direction.name} {counts}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""delay-proxy.py: a TCP forwarder that delays what it forwards while impaired (for chaos.sh).

chaos.sh uses it where the kernel has no `sch_netem`: it listens in a network namespace, forwards
each accepted connection to one upstream address, and passes bytes straight through until it
receives a signal; from then until SIGUSR2 every chunk read from either side is delivered after a
delay, in order (a TCP stream cannot be reordered as its reader sees it):

  SIGUSR1, delay:    each chunk is held --delay-ms +- --jitter-ms (uniform)
  SIGHUP, reorder:   each chunk is held --reorder-delay-ms, and --reorder-percent of them
                     --reorder-extra-ms more: what a reordered segment does to a TCP reader
                     (everything after it waits at the receiver until the late one arrives:
                     head-of-line blocking)

No chunk is delivered before the chunk read before it (jitter shows as bursts, as on a link).

A closed or failed side closes the other. Usage:
  delay-proxy.py --listen 127.0.0.1:14222 --upstream 10.77.1.1:4222 --delay-ms 50 --jitter-ms 10
"""

import argparse
import asyncio
import random
import signal
import sys
import time

CHUNK_BYTES = 64 * 1024


class Impairment:
    """Whether forwarding is impaired now, and how."""

    def __init__(self, args):
        self.args = args
        self.mode = "off"
        self.rng = random.Random(args.seed)

    def hold_secs(self):
        args = self.args
        if self.mode == "delay":
            hold = args.delay_ms + self.rng.uniform(-args.jitter_ms, args.jitter_ms)
        elif self.mode == "reorder":
            hold = args.reorder_delay_ms
            if self.rng.random() * 100 < args.reorder_percent:
                hold += args.reorder_extra_ms
        else:
            return 0.0
        return max(hold, 0.0) / 1000.0


async def pump(reader, writer, impairment):
    """Copy reader to writer, each chunk released at its due time (never before the previous)."""
    queue = asyncio.Queue(maxsize=1024)

    async def read_side():
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                await queue.put((time.monotonic() + impairment.hold_secs(), data))
        except (ConnectionError, OSError):
            pass
        await queue.put(None)

    async def write_side():
        last_due = 0.0
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                due, data = item
                due = max(due, last_due)
                last_due = due
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    await asyncio.gather(read_side(), write_side())


async def serve(args):
    impairment = Impairment(args)
    loop = asyncio.get_running_loop()

    def impair(mode):
        impairment.mode = mode
        print(f"delay-proxy {args.listen}: {mode}", flush=True)

    loop.add_signal_handler(signal.SIGUSR1, impair, "delay")
    loop.add_signal_handler(signal.SIGHUP, impair, "reorder")
    loop.add_signal_handler(signal.SIGUSR2, impair, "off")
    up_host, up_port = args.upstream.rsplit(":", 1)

    async def handle(client_reader, client_writer):
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(up_host, int(up_port)), timeout=5
            )
        except (OSError, asyncio.TimeoutError):
            client_writer.close()
            return
        await asyncio.gather(
            pump(client_reader, upstream_writer, impairment),
            pump(upstream_reader, client_writer, impairment),
        )

    host, port = args.listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    print(f"delay-proxy listening on {args.listen} -> {args.upstream}", flush=True)
    async with server:
        await server.serve_forever()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--delay-ms", type=float, default=50)
    parser.add_argument("--jitter-ms", type=float, default=0)
    parser.add_argument("--reorder-delay-ms", type=float, default=20)
    parser.add_argument("--reorder-percent", type=float, default=25)
    parser.add_argument("--reorder-extra-ms", type=float, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()

"""A minimal TCP throughput probe (no iperf needed): ``serve`` receives until the sender closes and
prints ``{"bytes": ..., "seconds": ...}``; ``send`` streams a buffer for a fixed time.

Run inside a namespace with ``ip netns exec NS python -m benchmarks.netprobe serve HOST PORT``.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

CHUNK_BYTES = 4 * 1024 * 1024


def serve(host: str, port: int, ready_file: str | None = None) -> dict[str, float]:
    """Accept one connection, count bytes until EOF; time runs from the first byte to EOF."""
    with socket.create_server((host, port), reuse_port=False) as server:
        if ready_file:
            with open(ready_file, "w") as f:
                f.write("ready")
        conn, _ = server.accept()
        with conn:
            buffer = bytearray(CHUNK_BYTES)
            received = conn.recv_into(buffer)
            start = time.perf_counter()
            total = 0
            while True:
                n = conn.recv_into(buffer)
                if n == 0:
                    break
                total += n
            seconds = time.perf_counter() - start
    del received  # the first read only starts the clock
    return {"bytes": total, "seconds": seconds}


def send(host: str, port: int, seconds: float, connect_timeout: float = 20.0) -> None:
    """Connect (retrying while the server starts) and stream zeros for ``seconds``."""
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=connect_timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = bytes(CHUNK_BYTES)
    with conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve")
    s.add_argument("host")
    s.add_argument("port", type=int)
    s.add_argument("--ready-file")
    c = sub.add_parser("send")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    if args.role == "serve":
        print(json.dumps(serve(args.host, args.port, args.ready_file)), flush=True)
    else:
        send(args.host, args.port, args.seconds)


if __name__ == "__main__":
    main()

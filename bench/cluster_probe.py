"""A raw TCP transfer, to check the simulated cluster's links before its rows (bench/cluster.py).

    python bench/cluster_probe.py serve PORT            # answers PUT/GET requests until killed
    python bench/cluster_probe.py measure HOST PORT MB  # prints {"up_mbs": .., "down_mbs": ..}

"up" sends MB megabytes (10**6 bytes) to the server, "down" receives as many from it; each speed
is the bytes over the time until the last byte was acknowledged (up) or received (down).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def _read_exact(conn: socket.socket, n: int) -> None:
    while n > 0:
        got = conn.recv(min(CHUNK, n))
        if not got:
            raise ConnectionError("peer closed mid-transfer")
        n -= len(got)


def _send(conn: socket.socket, n: int) -> None:
    block = b"\0" * CHUNK
    while n > 0:
        conn.sendall(block[:min(CHUNK, n)])
        n -= min(CHUNK, n)


def _header(conn: socket.socket) -> bytes:
    """The request line, read a byte at a time (a buffered reader would swallow payload)."""
    line = b""
    while not line.endswith(b"\n"):
        got = conn.recv(1)
        if not got:
            raise ConnectionError("peer closed before its request")
        line += got
    return line


def _handle(conn: socket.socket) -> None:
    with conn:
        verb, size = _header(conn).split()
        if verb == b"PUT":
            _read_exact(conn, int(size))
            conn.sendall(b"ok\n")
        else:
            _send(conn, int(size))


def serve(port: int) -> None:
    listener = socket.create_server(("0.0.0.0", port), reuse_port=True)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def measure(host: str, port: int, mb: float) -> dict[str, float]:
    n = int(mb * 1e6)
    with socket.create_connection((host, port), timeout=120) as conn:
        t0 = time.perf_counter()
        conn.sendall(f"PUT {n}\n".encode())
        _send(conn, n)
        _read_exact(conn, 3)
        up = time.perf_counter() - t0
    with socket.create_connection((host, port), timeout=120) as conn:
        t0 = time.perf_counter()
        conn.sendall(f"GET {n}\n".encode())
        _read_exact(conn, n)
        down = time.perf_counter() - t0
    return {"up_mbs": n / up / 1e6, "down_mbs": n / down / 1e6}


def main(argv: list[str]) -> int:
    if argv[0] == "serve":
        serve(int(argv[1]))
        return 0
    print(json.dumps(measure(argv[1], int(argv[2]), float(argv[3]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

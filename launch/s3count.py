"""A counting HTTP/1.1 proxy in front of an S3 server: one JSON line per request, at the service.

    python launch/s3count.py --listen 0.0.0.0:8334 --upstream s3:8333 --log /logs/s3-requests.jsonl

Every request a client sends to --listen is forwarded unchanged (headers included, so SigV4
signatures, which cover the Host header, still verify) to --upstream, and its response returned
unchanged; then one line is appended to --log:

    {"t": 1765123456.123456, "method": "GET", "path": "/ckpt/run/step-000000010/manifest.json",
     "status": 200, "bytes": 52311, "sent": 0}

`t` is the wall clock when the request's head arrived (a request a client made before a moment of
its own clock is logged before it: containers share the host's clock), `bytes` the response
body's length (what the client read), `sent` the request body's (what it uploaded). `make compose-demo-memory` puts it
between the trainer nodes and SeaweedFS and reads the log to count what a restore read from S3
(launch/compose_demo.py). Standard library only: it runs in the same image as the cluster.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from typing import BinaryIO

Head = tuple[str, dict[str, str], bytes]  # (first line, lower-cased headers, the raw head)


def read_head(reader: BinaryIO) -> Head | None:
    """A request's or response's head, or None where the peer closed before sending one."""
    first = reader.readline()
    if not first:
        return None
    raw, headers = first, {}
    while True:
        line = reader.readline()
        if not line:
            raise ValueError("connection closed inside the headers")
        raw += line
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return first.decode("latin-1").rstrip("\r\n"), headers, raw


def read_body(reader: BinaryIO, headers: dict[str, str], response_status: int | None = None) -> bytes:
    """The body as sent (chunked framing kept, so it is forwarded byte for byte)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            size_line = reader.readline()
            out += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, up to the blank line
                    trailer = reader.readline()
                    out += trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        return out
            out += reader.read(size + 2)
    if "content-length" in headers:
        return reader.read(int(headers["content-length"]))
    if response_status is not None and response_status >= 200 and response_status not in (204, 304):
        return reader.read()  # a response without a length ends when the server closes
    return b""


def without_header(raw_head: bytes, name: bytes) -> bytes:
    return b"\r\n".join(line for line in raw_head.split(b"\r\n") if not line.lower().startswith(name + b":"))


class CountingProxy:
    """Forwards every connection to the upstream server and logs each exchange to `log_path`."""

    def __init__(self, upstream: tuple[str, int], log_path: str) -> None:
        self.upstream = upstream
        self.log = open(log_path, "a", buffering=1)  # line-buffered: the log is read while we run
        self.lock = threading.Lock()

    def record(self, arrived: float, method: str, path: str, status: int, received: int, sent: int) -> None:
        line = json.dumps({"t": round(arrived, 6), "method": method, "path": path, "status": status,
                           "bytes": received, "sent": sent})
        with self.lock:
            self.log.write(line + "\n")

    def serve(self, listen: tuple[str, int]) -> None:
        server = socket.create_server(listen, reuse_port=False, backlog=128)
        while True:
            client, _ = server.accept()
            threading.Thread(target=self.relay, args=(client,), daemon=True).start()

    def relay(self, client: socket.socket) -> None:
        """One client connection, request after request (keep-alive), over one upstream connection."""
        upstream: socket.socket | None = None
        reader = client.makefile("rb")
        try:
            while (head := read_head(reader)) is not None:
                arrived = time.time()
                request_line, headers, raw_head = head
                method, path, _ = request_line.split(" ", 2)
                if headers.get("expect", "").lower() == "100-continue":
                    # answered here, so the server gets the body with the head and no Expect
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    raw_head = without_header(raw_head, b"expect")
                body = read_body(reader, headers)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    up_reader = upstream.makefile("rb")
                upstream.sendall(raw_head + body)
                response = read_head(up_reader)
                if response is None:
                    raise ValueError("the server closed the connection without a response")
                status_line, response_headers, response_raw = response
                status = int(status_line.split()[1])
                response_body = b"" if method == "HEAD" else read_body(up_reader, response_headers, status)
                client.sendall(response_raw + response_body)
                self.record(arrived, method, path, status, len(response_body), len(body))
        except (OSError, ValueError):
            return  # a client or server that went away: nothing to count
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    sock.close()


def address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=address, required=True, help="HOST:PORT the clients connect to")
    p.add_argument("--upstream", type=address, required=True, help="HOST:PORT of the S3 server")
    p.add_argument("--log", required=True, help="the JSON-lines file each request is appended to")
    args = p.parse_args(argv)
    proxy = CountingProxy(args.upstream, args.log)
    print(f"s3count: {args.listen[0]}:{args.listen[1]} -> {args.upstream[0]}:{args.upstream[1]}, log {args.log}",
          flush=True)
    proxy.serve(args.listen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

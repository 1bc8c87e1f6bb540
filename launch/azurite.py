"""Azurite's blob service (the `azurite` package from the npm registry, installed by `make
install` into .venv/azurite) on a free loopback port, for the Azure runs of the storage contract
suite. Its well-known development account and key are Azurite's own, public by design.

    python launch/azurite.py            # serves until Ctrl-C, prints the connection string
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from loopback import free_port, stop_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def binary() -> str:
    path = os.environ.get("DISTCKPT_AZURITE") or os.path.join(ROOT, ".venv", "azurite", "node_modules", ".bin",
                                                               "azurite-blob")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no Azurite at {path}: `make install` installs it with npm (or set DISTCKPT_AZURITE)")
    return path


@dataclass
class Azurite:
    workdir: str
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};")

    def storage_options(self) -> dict:
        return {"connection_string": self.connection_string}

    def start(self, timeout: float = 60) -> "Azurite":
        os.makedirs(self.workdir, exist_ok=True)
        self.port = self.port or free_port()
        cmd = [binary(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence",
               "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
        log = open(os.path.join(self.workdir, "azurite.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"azurite exited with {self.proc.returncode}; see {self.workdir}/azurite.log")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"azurite did not listen within {timeout}s")

    def make_container(self, name: str) -> None:
        from adlfs import AzureBlobFileSystem

        AzureBlobFileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)

    def stop(self) -> None:
        stop_group(self.proc, grace_s=2)  # in memory: nothing to flush; it lingered 15 s on SIGTERM


if __name__ == "__main__":
    import tempfile

    server = Azurite(tempfile.mkdtemp(prefix="azurite-")).start()
    print(server.connection_string, flush=True)
    try:
        signal.pause()
    finally:
        server.stop()

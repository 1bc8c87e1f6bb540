"""Payload reads through the AWS CRT client of `s3torchconnector` (``pip install 'distckpt[s3-crt]'``).

Opt-in (``storage_options={"client": "crt"}``), not the default, by measurement on loopback
SeaweedFS (256 MiB object, fresh process, bench/s3_fresh.py): one CRT GET stream (the client
splits it into concurrent ranged parts itself) read it in 0.54–0.80 s, 2x s3fs `cat`, but so
did s3fs's own 8 concurrent ranged GETs of 8 MiB (0.62–0.92 s into a download file), with
60 MiB in memory at the peak against 230–350 MiB of the CRT client's buffers (its throughput
target at 2 instead of 10 Gbit/s did not bound them; 8 threads of 8 MiB ranged CRT GETs took
0.9–1.3 s and 160 MiB). On a real S3 endpoint the CRT client's connection handling may win;
bench/s3_fresh.py measures both. Writes stay on s3fs: a CRT upload of the same bytes took
3.0–3.3 s against 2.5 s for s3fs multipart parts sent 8 at a time, and the commit marker needs
``If-None-Match: *``, which the CRT client cannot send. Listings, deletes and the marker stay on
s3fs too, so the commit rule is the same whichever client reads.

The CRT client takes credentials only from the standard chain (AWS_* environment, profiles,
instance roles): with a key or token given in `storage_options` it is refused (they would
otherwise be silently ignored for another identity in the environment).

This module never imports torch.distributed.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from typing import Any

from distckpt.errors import ConfigError, StorageError, shown
from distckpt.runtime.interrupts import Task, start_thread
from distckpt.storage import s3
from distckpt.storage.registry import register_backend
from distckpt.storage.spill import write_at

CLIENT_CHOICES = ("s3fs", "crt")
EXPLICIT_CREDENTIALS = ("key", "secret", "token", "anon", "aws_access_key_id", "aws_secret_access_key",
                        "aws_session_token")
CRT_PART_BYTES = 8 * 2**20  # 8 / 16 MiB parts read 256 MiB in 0.62 / 0.63 s here, 32 MiB in 0.99 s


def crt_available() -> bool:
    try:
        import s3torchconnector  # noqa: F401
    except ImportError:
        return False
    return True


def choose_client(choice: object, options: dict[str, Any]) -> bool:
    """Whether payload reads go through the CRT client (the `client` storage option)."""
    if choice not in CLIENT_CHOICES:
        raise ConfigError(f"client={shown(choice)}: must be one of {', '.join(map(repr, CLIENT_CHOICES))} "
                          "(crt: the CRT client of s3torchconnector reads payload files)")
    if choice == "s3fs":
        return False
    if not crt_available():
        raise ConfigError(f"client='crt' needs the s3torchconnector package: {SPEC.install_hint}")
    explicit = [k for k in EXPLICIT_CREDENTIALS if options.get(k) not in (None, False)]
    if explicit:
        raise ConfigError(f"client='crt' takes credentials only from the environment or a profile, "
                          f"but storage_options give {', '.join(explicit)}; set AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY (or a profile) instead, or use client='s3fs'")
    return True


class CrtReader:
    """Whole-object GETs into a download file; one client per process (rebuilt after a fork)."""

    def __init__(self, options: dict[str, Any], max_attempts: int) -> None:
        kwargs = options.get("client_kwargs") or {}
        self.endpoint = options.get("endpoint_url") or kwargs.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
        self.region = (kwargs.get("region_name") or os.environ.get("AWS_REGION")
                       or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        self.profile = options.get("profile")
        self.max_attempts = max_attempts
        self._client: Any = None

    def __repr__(self) -> str:
        return f"CrtReader(endpoint={self.endpoint!r}, region={self.region!r})"

    def client(self) -> Any:
        if self._client is None:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client

            # A custom endpoint (SeaweedFS, MinIO …) takes path-style requests.
            config = S3ClientConfig(part_size=CRT_PART_BYTES, force_path_style=self.endpoint is not None,
                                    max_attempts=self.max_attempts, profile=self.profile)
            self._client = S3Client(self.region, endpoint=self.endpoint, s3client_config=config)
        return self._client

    def download(self, bucket: str, key: str, size: int, fd: int, deadline_s: float, where: str) -> None:
        """Write the object into `fd` from offset 0, or raise StorageError (ETIMEDOUT after
        `deadline_s`: the native call cannot be interrupted, so it runs on a thread of its own,
        which keeps its own handle on the file and is left to finish)."""
        own_fd = os.dup(fd)

        def run() -> None:
            try:
                self._stream_into(bucket, key, size, own_fd, where)
            finally:
                os.close(own_fd)

        reading = Task(run, ())  # waited on through a Gate: a Ctrl-C cannot wedge it (interrupts.py)
        start_thread(threading.Thread(target=reading.run, name="distckpt-crt-get", daemon=True))
        if not reading.wait(deadline_s):
            raise StorageError(errno.ETIMEDOUT, f"reading {where} took longer than {deadline_s:.0f}s: the S3 "
                               "server is unreachable, stopped or too slow")
        reading.result()

    def _stream_into(self, bucket: str, key: str, size: int, fd: int, where: str) -> None:
        from s3torchconnectorclient import S3Exception

        offset = 0
        try:
            # The client's own stream: S3Client.get_object's reader keeps every byte read in a
            # buffer of its own, the whole object again.
            for chunk in self.client()._get_object_stream(bucket, key):
                if offset + len(chunk) > size:
                    raise StorageError(errno.EIO, f"reading {where}: more than the {size} bytes it had")
                write_at(fd, chunk, offset)
                offset += len(chunk)
        except S3Exception as e:
            raise StorageError(errno.EIO, f"reading {where} failed: {e}") from e
        if offset != size:
            raise StorageError(errno.EIO, f"reading {where}: short read, {offset} of {size} bytes")


# S3 as s3.py opens it (listings, writes and the marker on s3fs), chosen by client="crt".
SPEC = register_backend(dataclasses.replace(
    s3.SPEC, name="s3-crt", selected_by=(("client", "crt"),),
    client_packages=(*s3.SPEC.client_packages, "s3torchconnector", "s3torchconnectorclient"),
    install_hint="pip install 'distckpt[s3-crt]'"))

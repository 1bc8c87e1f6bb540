"""Google Cloud Storage through gcsfs (``pip install 'distckpt[gcs]'``), ``gs://bucket/prefix``.

* A file is put whole: gcsfs sends one request below 50 MiB, else a resumable upload whose
  object exists only once its last chunk is finalized (on a failure gcsfs deletes the session).
  The file's chunks are joined first, so a write holds one copy of the file in memory (the S3
  backend streams parts instead; streamed GCS uploads are not built).
* The commit marker is created with ``ifGenerationMatch=0``, GCS's native exclusive create (HTTP
  412 when the object exists), and read back on any error (conditional.py).
* Listings bypass gcsfs's listing cache (FsspecStorage invalidates before each).
* Credentials: gcsfs's own (``token=`` in `storage_options`, application default credentials,
  ``GOOGLE_APPLICATION_CREDENTIALS``); ``endpoint_url`` points it at an emulator.

This module never imports torch.distributed.
"""

from __future__ import annotations

import errno
from typing import Any

from distckpt.errors import MissingFileError, StorageError
from distckpt.storage.conditional import ConditionalCreateStorage
from distckpt.storage.registry import BackendSpec, register_backend


class GcsStorage(ConditionalCreateStorage):
    """Checkpoints under gs://bucket/prefix."""

    client_name = "GCSFileSystem"

    @staticmethod
    def make_client(options: dict[str, Any]) -> Any:
        # The plain client: gcsfs's default class (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT) asks a gRPC
        # control plane for each bucket's type first, which an emulator or a firewall answers
        # only after its 60 s timeout. Zonal buckets are not supported through it.
        from gcsfs.core import GCSFileSystem
        return GCSFileSystem(**options)

    def _call(self, what: str, target: str, method: str, *args: Any, size: int = 0, **kwargs: Any) -> Any:
        try:
            return super()._call(what, target, method, *args, size=size, **kwargs)
        except MissingFileError as e:  # gcsfs: 404 on an upload means the bucket is missing
            if what not in ("writing", "creating"):
                raise
            raise StorageError(errno.ENOENT, f"{what} {self.public(target)} failed: not found "
                               "(does the bucket exist?)") from e


SPEC = register_backend(BackendSpec(
    name="gcs", schemes=("gs", "gcs"), open=GcsStorage.from_url, exclusive_create=True,
    container=GcsStorage.container_word, client_packages=("gcsfs", "google", "aiohttp"),
    install_hint="pip install 'distckpt[gcs]'",
    jitter_modules=("gcsfs.retry", "gcsfs.core"),  # retries and token refresh drew from the global `random`
    secret_env=(),  # GOOGLE_APPLICATION_CREDENTIALS names a file, it holds no secret itself
    secret_options=("token",),  # a dict token's private fields are found by redact.py
    credential_env_prefixes=("GOOGLE_", "GCLOUD", "CLOUDSDK_", "FSSPEC_"), selected_by=()))

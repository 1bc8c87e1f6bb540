"""Azure Blob Storage through adlfs (``pip install 'distckpt[azure]'``): ``az://container/prefix``
(also ``abfs://`` and ``abfss://``).

* A file is put whole: adlfs uploads a block blob, staging blocks and committing the block list
  last, so the blob appears whole or not at all. The chunks are joined first: a write holds one
  copy of the file in memory.
* The commit marker is created with ``If-None-Match: *`` (adlfs's ``mode="create"``; HTTP 409
  when the blob exists) and read back on any error (conditional.py).
* Credentials: adlfs's own (``account_name`` + ``account_key``, ``sas_token``,
  ``connection_string``, or ``anon=False`` for the default Azure credential chain).

This module never imports torch.distributed.
"""

from __future__ import annotations

from typing import Any

from .conditional import ConditionalCreateStorage


class AzureStorage(ConditionalCreateStorage):
    """Checkpoints under az://container/prefix."""

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> "AzureStorage":
        from adlfs import AzureBlobFileSystem

        options = dict(storage_options)
        options.setdefault("skip_instance_cache", True)  # one owned client per manager
        fs = AzureBlobFileSystem(**options)
        root = url.split("://", 1)[1].rstrip("/")
        return cls(fs, root, url)

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

import errno
from typing import Any

from distckpt.errors import CheckpointExistsError, MissingFileError, StorageError
from distckpt.storage.conditional import ConditionalCreateStorage
from distckpt.storage.registry import BackendSpec, register_backend


class AzureStorage(ConditionalCreateStorage):
    """Checkpoints under az://container/prefix."""

    client_name = "AzureBlobFileSystem"
    container_word = "container"

    @staticmethod
    def make_client(options: dict[str, Any]) -> Any:
        from adlfs import AzureBlobFileSystem
        return AzureBlobFileSystem(**options)

    def _call(self, what: str, target: str, method: str, *args: Any, size: int = 0, **kwargs: Any) -> Any:
        """adlfs lets the Azure SDK's own exceptions through on some paths (an upload into a
        container that does not exist raised ResourceNotFoundError): they become the same
        errors as every other backend's, with the first line of the service's message."""
        from azure.core.exceptions import AzureError, ClientAuthenticationError, ResourceExistsError, ResourceNotFoundError

        try:
            return super()._call(what, target, method, *args, size=size, **kwargs)
        except ResourceNotFoundError as e:
            message = f"{what} {self.public(target)} failed: {_first_line(e)}"
            if what.startswith("reading"):
                raise MissingFileError(errno.ENOENT, message) from e
            raise StorageError(errno.ENOENT, message + " (does the container exist?)") from e
        except ResourceExistsError as e:
            raise CheckpointExistsError(errno.EEXIST, f"{self.public(target)} already exists") from e
        except ClientAuthenticationError as e:
            raise StorageError(errno.EACCES, f"{what} {self.public(target)} failed: {_first_line(e)}") from e
        except AzureError as e:
            raise StorageError(errno.EIO, f"{what} {self.public(target)} failed: {type(e).__name__}: "
                               f"{_first_line(e)}") from e



SPEC = register_backend(BackendSpec(
    name="azure", schemes=("az", "abfs", "abfss"), open=AzureStorage.from_url, exclusive_create=True,
    container=AzureStorage.container_word, client_packages=("adlfs", "azure"),
    install_hint="pip install 'distckpt[azure]'",
    # azure-core's token refresh drew its jitter from the global `random`
    jitter_modules=("azure.core.pipeline.policies._authentication", "azure.core.pipeline.policies._authentication_async"),
    secret_env=("AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET",
                "AZURE_STORAGE_CONNECTION_STRING"),
    secret_options=("account_key", "sas_token", "connection_string", "credential", "client_secret"),
    credential_env_prefixes=("AZURE_", "FSSPEC_"), selected_by=()))


def _first_line(e: BaseException) -> str:
    text = str(getattr(e, "message", None) or e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__

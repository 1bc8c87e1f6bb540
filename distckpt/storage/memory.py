"""fsspec's in-process file system, ``memory://<path>``: checkpoints that last as long as the
process (tests, notebooks). Its ``open(..., "xb")`` is a real exclusive create, so the commit
marker is created exclusively, as on disk.

This module never imports torch.distributed.
"""

from __future__ import annotations

from typing import Any

from distckpt.storage.fsspec_fs import FsspecStorage, open_fsspec
from distckpt.storage.registry import BackendSpec, register_backend


def open_memory(url: str, options: dict[str, Any]) -> FsspecStorage:
    return open_fsspec(url, options, exclusive_create=True)


SPEC = register_backend(BackendSpec(
    name="memory", schemes=("memory",), open=open_memory, exclusive_create=True, container=None,
    client_packages=(), install_hint="", jitter_modules=(), secret_env=(), secret_options=(), credential_env_prefixes=(),
    selected_by=()))

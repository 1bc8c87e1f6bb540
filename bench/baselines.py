"""Baselines the benchmark rows share (fresh.py's child process keeps its own copy: it runs as a
`python -c` script)."""

from __future__ import annotations

import os
from typing import Any

import torch


def torch_save_durably(obj: Any, path: str) -> None:
    """torch.save + fsync + os.replace: what a careful hand-written checkpoint does."""
    with open(path + ".tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)

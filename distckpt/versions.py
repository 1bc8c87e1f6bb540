"""The environment a checkpoint was written in: costs bytes, saves guessing later."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any

import numpy as np
import torch


def collect_versions() -> dict[str, str | None]:
    """Every value a string or None, as the manifest's schema wants (cuDNN's version is an int
    on GPU builds: taken as it came, it failed every save on a GPU machine)."""
    from . import __version__

    found: dict[str, Any] = {
        "distckpt": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
    return {name: None if value is None else str(value) for name, value in found.items()}


def _git_commit() -> str | None:
    """The commit of the training code (the directory of the main script), where it is a git tree."""
    main = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else os.getcwd()
    where = os.path.dirname(main) if os.path.isfile(main) else os.getcwd()
    try:
        out = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    try:  # a slow or hung git (a network file system) must not fail the manager's construction
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return out.stdout.strip() + "-unknown-dirty"
    return out.stdout.strip() + ("-dirty" if dirty else "")

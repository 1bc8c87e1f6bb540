"""Small adaptors for the frameworks people train with, each optional: its framework is not a
dependency of distckpt, and each module imports without it (the framework is imported inside the
functions that need it; a missing one is a ConfigError naming the package to install).

* `accelerate`: Hugging Face Accelerate (make_accelerator: the restart-safe process group, the
  CPU world, prepared loaders that can resume);
* `hf_trainer`: the Hugging Face `Trainer` (a TrainerCallback that checkpoints through a manager);
* `fabric`: Lightning Fabric;
* `timm`: timm's training script (its prefetching loader and its scheduler's per-rank metric).

Each is imported by name: `from distckpt.integrations import accelerate`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from distckpt.errors import ConfigError

__all__ = ["accelerate", "fabric", "hf_trainer", "timm"]


def require(module: str, package: str, what: str) -> ModuleType:
    """Import `module` of a framework, or raise ConfigError naming the pip package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{what} needs {package} (pip install {package}): {e}") from e

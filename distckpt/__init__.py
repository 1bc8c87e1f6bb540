"""distckpt: exact-resume checkpoints for torchrun jobs, on local disk or any fsspec URL.

The public surface is this module. Names are imported on first use (PEP 562), so that
``import distckpt`` and ``distckpt --help`` do not pay for importing torch.

Layout (dependencies point down this list)::

    distckpt/
      manager.py   CheckpointManager: the facade users call
      tools/       the command line, doctor, weights in and out, importers, inspection
      protocol/    save and load as named phases; commit, fencing, manifest, retention, tiers
      state/       entry kinds, random streams, replayed samplers, validation, undo
      io/          serialization (no pickle), staging buffers, copies, checksums, verified reads
      storage/     one module per backend, registered by URL scheme
      runtime/     process group start-up, pre-emption, interrupts, versions
      errors.py    every error and warning, in two trees
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_ERRORS = (
    "ArgumentNameError", "AsyncSaveError", "CheckpointExistsError", "ConfigError", "CoordinationError",
    "CorruptCheckpointError", "DistCkptError", "ElasticResumeError", "FencedError", "IncompatibleCheckpointError",
    "MemoryTierFullError", "MissingFileError", "RankDisagreementError", "RunConflictError", "SnapshotChangedError",
    "StateArgumentError", "StorageError",
    "SupersededCheckpointError", "UnstorableValueError", "UntrustedCheckpointError",
    "DistCkptWarning", "CheckpointWarning", "ReplayWarning", "CheckpointFallbackWarning", "ReshardWarning",
    "DurableUploadWarning", "NonAtomicStorageWarning", "RngRestoreWarning", "DeviceAbsentWarning",
)
_WHERE: dict[str, str] = {name: "distckpt.errors" for name in _ERRORS}
_WHERE.update({
    "CheckpointManager": "distckpt.manager",
    "PerRank": "distckpt.state.capture", "per_rank": "distckpt.state.capture",
    "DistInfo": "distckpt.runtime.dist", "init_distributed": "distckpt.runtime.dist",
    "shutdown_distributed": "distckpt.runtime.dist",
    "Progress": "distckpt.protocol.loading",
    "WeightsReport": "distckpt.tools.weights", "export_weights": "distckpt.tools.weights",
    "load_weights": "distckpt.tools.weights",
    "doctor_record": "distckpt.protocol.doctor_hooks",
    "preemption_safe_worker_init": "distckpt.runtime.worker_signals", "with_worker_rng": "distckpt.state.workers",
})
_SUBMODULES = ("config", "errors", "io", "manager", "protocol", "runtime", "state", "storage", "testing", "tools")
_RENAMED = {"PREEMPTED_EXIT_CODE": ("distckpt.runtime.preemption", "EXIT_CODE")}

__all__ = [
    "ArgumentNameError", "AsyncSaveError", "CheckpointExistsError", "CheckpointFallbackWarning",
    "CheckpointManager", "CheckpointWarning", "ConfigError", "CoordinationError",
    "CorruptCheckpointError", "DeviceAbsentWarning", "DistCkptError", "DistCkptWarning", "DistInfo",
    "DurableUploadWarning", "ElasticResumeError", "FencedError", "IncompatibleCheckpointError",
    "MemoryTierFullError", "MissingFileError", "NonAtomicStorageWarning", "PREEMPTED_EXIT_CODE", "PerRank",
    "Progress", "RankDisagreementError",
    "ReplayWarning", "ReshardWarning", "RngRestoreWarning", "RunConflictError", "SnapshotChangedError",
    "StateArgumentError", "StorageError", "SupersededCheckpointError", "UnstorableValueError",
    "UntrustedCheckpointError", "WeightsReport", "__version__", "doctor_record", "export_weights", "init_distributed",
    "load_weights", "per_rank",
    "preemption_safe_worker_init", "shutdown_distributed", "with_worker_rng",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _RENAMED:
        module, attr = _RENAMED[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"distckpt.{name}")
    else:
        raise AttributeError(f"module 'distckpt' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and the docs generator see; not run
    from distckpt.errors import (
        ArgumentNameError,
        AsyncSaveError,
        CheckpointExistsError,
        CheckpointFallbackWarning,
        CheckpointWarning,
        ConfigError,
        CoordinationError,
        CorruptCheckpointError,
        DeviceAbsentWarning,
        DistCkptError,
        DistCkptWarning,
        DurableUploadWarning,
        ElasticResumeError,
        FencedError,
        IncompatibleCheckpointError,
        MemoryTierFullError,
        MissingFileError,
        NonAtomicStorageWarning,
        RankDisagreementError,
        ReplayWarning,
        ReshardWarning,
        RngRestoreWarning,
        RunConflictError,
        SnapshotChangedError,
        StateArgumentError,
        StorageError,
        SupersededCheckpointError,
        UnstorableValueError,
        UntrustedCheckpointError,
    )
    from distckpt.manager import CheckpointManager
    from distckpt.protocol.doctor_hooks import doctor_record
    from distckpt.protocol.loading import Progress
    from distckpt.runtime.dist import DistInfo, init_distributed, shutdown_distributed
    from distckpt.runtime.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE
    from distckpt.runtime.worker_signals import preemption_safe_worker_init
    from distckpt.state.capture import PerRank, per_rank
    from distckpt.state.workers import with_worker_rng
    from distckpt.tools.weights import WeightsReport, export_weights, load_weights

"""distckpt: exact-resume checkpoints for torchrun jobs, on local disk or any fsspec URL."""

from __future__ import annotations

__version__ = "0.1.0"

from .capture import CheckpointWarning, PerRank, per_rank
from .dist import DistInfo, init_distributed, shutdown_distributed
from .errors import (
                     ArgumentNameError,
                     AsyncSaveError,
                     CheckpointExistsError,
                     ConfigError,
                     CoordinationError,
                     CorruptCheckpointError,
                     DistCkptError,
                     FencedError,
                     IncompatibleCheckpointError,
                     MissingFileError,
                     RankDisagreementError,
                     RunConflictError,
                     SnapshotChangedError,
                     StateArgumentError,
                     StorageError,
                     SupersededCheckpointError,
                     UnstorableValueError,
)
from .loading import CheckpointFallbackWarning, Progress, ReshardWarning
from .manager import CheckpointManager
from .preemption import EXIT_CODE as PREEMPTED_EXIT_CODE
from .replay import ReplayWarning
from .rng import RngRestoreWarning
from .serialize import DeviceAbsentWarning
from .storage import NonAtomicStorageWarning
from .tiers import DurableUploadWarning
from .weights import WeightsReport, export_weights, load_weights
from .workers import preemption_safe_worker_init, with_worker_rng

__all__ = [
    "ArgumentNameError", "AsyncSaveError", "CheckpointExistsError", "CheckpointFallbackWarning", "CheckpointManager",
    "CheckpointWarning", "ConfigError", "CoordinationError", "CorruptCheckpointError", "DistCkptError",
    "DeviceAbsentWarning", "DistInfo", "DurableUploadWarning", "FencedError", "IncompatibleCheckpointError", "MissingFileError", "NonAtomicStorageWarning", "PREEMPTED_EXIT_CODE", "PerRank", "Progress",
    "RankDisagreementError", "ReplayWarning", "ReshardWarning", "RngRestoreWarning", "RunConflictError", "SnapshotChangedError", "StateArgumentError", "StorageError",
    "SupersededCheckpointError", "UnstorableValueError",
    "WeightsReport", "__version__", "export_weights", "init_distributed", "load_weights", "per_rank",
    "preemption_safe_worker_init", "shutdown_distributed", "with_worker_rng",
]

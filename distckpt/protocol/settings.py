"""A manager's settings: every argument checked before any exchange, then agreed by every rank.

A refusal on one rank only (a local_dir that is a file on one node, an unreachable store) is
raised on every rank alike, with the failing rank's error type (refusal_on_every_rank): raised
at once it left the other ranks waiting for this one's group for the whole timeout. The
settings every rank must share are compared in the same exchange, which also hands every rank
rank 0's run id. The per-call arguments of save() are checked here too.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import uuid
from dataclasses import dataclass
from typing import Any

from distckpt import errors
from distckpt.config import ManagerConfig
from distckpt.errors import CheckpointWarning, ConfigError, CoordinationError, DistCkptError, shown, warn
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.protocol import doctor_hooks
from distckpt.protocol.coord import Coordinator
from distckpt.protocol.frameworks import negative_step_refusal
from distckpt.protocol.memory_tier import MemorySettings
from distckpt.protocol.split_default import resolve_split_writes
from distckpt.protocol.tiers import TierSettings
from distckpt.protocol.writer_process import check_storage
from distckpt.state.validation import check_step
from distckpt.storage import Storage, open_storage


@dataclass(frozen=True)
class Settings:
    """What a CheckpointManager is built with, checked: its config, its URL and storage, and the
    two-tier settings with the local tier's storage (None with one tier)."""

    config: ManagerConfig
    url: str
    storage: Storage
    tiers: TierSettings
    local: Storage | None
    memory: MemorySettings = MemorySettings()
    trust: signing.Trust | None = None  # signing_key / verify_key, parsed (io/signing.py)

    def shared(self) -> dict[str, Any]:
        """What every rank must hold alike: the config's shared settings, the memory tier's, the keys by
        fingerprint."""
        keys = self.trust.shared_settings() if self.trust is not None else {"signing_key": None, "verify_key": None}
        return {**self.config.shared_settings(), **self.memory.shared(), **keys}

    @classmethod
    def check(cls, url: Any, storage_options: Any, local_dir: Any, durable_every: Any, keep_local: Any,
              config: ManagerConfig, memory: tuple[Any, ...] = (False, None, None, None)) -> "Settings":
        """Every argument (the config's own were checked as it was built); raises the first refusal."""
        if config.keep_best is not None and config.keep_last is None:
            warn(f"keep_best={config.keep_best} without keep_last keeps every step: retention keeps "
                          "the newest keep_last steps and the keep_best best ones, and keep_last=None keeps all; "
                          "set keep_last too (keep_last=1 keeps the newest, to resume from)", CheckpointWarning)
        # `distckpt doctor` runs the job into roots of its own (DISTCKPT_DOCTOR_ROOT; README)
        storage = open_storage(doctor_hooks.root_override(url), storage_options)
        mf.refuse_step_directory(storage.url)
        tiers = TierSettings.check(storage.url, doctor_hooks.local_override(local_dir), durable_every, keep_local)
        if tiers.local_dir is not None:
            mf.refuse_step_directory(tiers.local_dir, "local_dir")
        local = open_storage(tiers.local_dir) if tiers.local_dir is not None else None
        in_memory = MemorySettings.check(storage.url, *memory)
        if in_memory.enabled and config.split_writes is None:  # a memory copy holds whole files (below)
            config = dataclasses.replace(config, split_writes=False)
        config = resolve_split_writes(config, storage.url, tiers.local_dir)  # None: decided (split_default.py)
        if config.incremental and tiers.local_dir is not None:
            raise ConfigError("incremental=True with local_dir= is not supported yet: an upload would have to "
                              "carry the files each step references; use one of the two")
        if config.incremental and config.split_writes:
            # refused, not accepted: split writes put the replicated tensors in the ranks' shard
            # files, which are written whole, so every save would silently write everything again
            raise ConfigError("incremental=True with split_writes=True is not supported: incremental saves "
                              "leave out the unchanged tensors of rank 0's file, and split writes move them to "
                              "every rank's shard file, written whole at each save; use one of the two")
        if in_memory.enabled and (config.incremental or config.split_writes):
            name = "incremental=True" if config.incremental else "split_writes=True"
            raise ConfigError(f"memory_tier=True with {name} is not supported: a node's memory copy holds the "
                              "replicated file and its own ranks' files whole, so it could not hold "
                              + ("the files each step references from older ones" if config.incremental else
                                 "the replicated tensors split across every rank's shard file") + "; use one of the two")
        if in_memory.enabled and config.staging_bytes is not None:
            # a memory copy is made from the staged bytes after the commit; under a bound part of
            # them were read from the live tensors, which training may have changed since
            raise ConfigError("memory_tier=True with staging_bytes= is not supported: the memory copy is made "
                              "from the staged save after its commit, and a bound leaves part of it in the live "
                              "tensors; use one of the two")
        if config.async_save and config.writer == "process":  # it opens them in another process
            for root in (storage, local):
                if root is not None:
                    check_storage(root)
        trust = signing.Trust.from_arguments(config.signing_key, config.verify_key)
        for opened in (storage, local):  # every read and write through them signs / verifies
            signing.attach(opened, trust)
        config = dataclasses.replace(config, signing_key=None, verify_key=None)  # parsed: the raw key is let go
        return cls(config, os.fspath(url) if isinstance(url, os.PathLike) else url, storage, tiers, local, in_memory,
                   trust)


def agree_on_settings(coord: Coordinator, settings: Settings | None, refusal: Exception | None) -> str:
    """Rank 0's run id, and the settings every rank must share, compared (one exchange): a rank
    built with other retention, load rules or save modes than the others went unnoticed (only
    async_save was compared, at the first save). A rank whose arguments or storage were refused
    makes every rank raise that error's type (refusal_on_every_rank), naming it. On a refusal or
    a difference the group is closed before raising."""
    mine: dict[str, Any] = {"run_id": uuid.uuid4().hex, "refused": None if refusal is None else str(refusal),
                            "kind": type(refusal).__name__,
                            "settings": None if settings is None else settings.shared()}
    if coord.world_size == 1:
        return str(mine["run_id"])
    every = coord.all_gather(mine, "init/run-id")
    refused = [(r, view["kind"], view["refused"]) for r, view in enumerate(every) if view["refused"] is not None]
    if refused:
        coord.close()
        raise refusal_on_every_rank(refused) from refusal
    differing = sorted(name for name in every[0]["settings"]
                       if any(view["settings"].get(name) != every[0]["settings"][name] for view in every))
    if differing:
        coord.close()
        table = "; ".join(f"{name}: " + ", ".join(f"rank {r}: {view['settings'].get(name)!r}"
                                                 for r, view in enumerate(every)) for name in differing)
        raise ConfigError(f"the ranks built their CheckpointManager with different settings — {table}; build "
                          "every rank's manager with the same arguments")
    return str(every[0]["run_id"])


def refusal_on_every_rank(refused: list[tuple[int, str, str]]) -> DistCkptError:
    """The one error every rank raises when some ranks' constructors failed: the first failing
    rank's distckpt type (ConfigError, StorageError, ...), or CoordinationError for any other
    exception (the raising rank keeps it as __cause__), its message naming each failing rank."""
    message = "; ".join(f"rank {r}: {kind}: {text}" if not _is_distckpt_error(kind) else f"rank {r}: {text}"
                        for r, kind, text in refused)
    kind = refused[0][1]
    cls = getattr(errors, kind) if _is_distckpt_error(kind) else CoordinationError
    return cls(message)  # type: ignore[no-any-return]


def _is_distckpt_error(kind: str) -> bool:
    cls = getattr(errors, kind, None)
    return isinstance(cls, type) and issubclass(cls, DistCkptError)


def check_save_args(step: Any, epoch: Any, metric: Any) -> tuple[int, int | None, float | None]:
    """save()'s step, epoch and metric, checked (ConfigError naming the one refused)."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool) and step < 0:
        raise negative_step_refusal(int(step))  # says where saves belong
    step = check_step("step", step)
    if epoch is not None:
        epoch = check_step("epoch", epoch)
    if metric is not None:
        metric = check_metric(metric)
    return step, epoch, metric


def check_metric(metric: Any) -> float:
    """A finite number: int, float, NumPy number or a one-element tensor (a validation loss)."""
    if hasattr(metric, "numel") and callable(metric.numel) and metric.numel() == 1 \
            and not getattr(metric, "is_complex", lambda: False)():
        try:
            metric = metric.item()
        except (RuntimeError, ValueError) as e:  # a meta tensor has no value to read
            raise ConfigError(f"metric: a tensor whose value cannot be read ({e}); pass a number") from None
    if isinstance(metric, bool) or not isinstance(metric, numbers.Real):
        raise ConfigError(f"metric={shown(metric)}: must be a number (e.g. the validation loss), not "
                          f"{type(metric).__name__}")
    try:
        value = float(metric)
    except OverflowError:
        raise ConfigError(f"metric={shown(metric)}: too large for a float") from None
    if not math.isfinite(value):
        raise ConfigError(f"metric={shown(metric)}: must be finite to rank checkpoints by it")
    return value

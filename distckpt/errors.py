"""Errors and warnings raised by distckpt.

Every error derives from :class:`DistCkptError`, so ``except distckpt.DistCkptError`` catches
everything the library raises on purpose. Storage failures also derive from the matching
builtin, so code that already handles ``OSError`` keeps working::

    DistCkptError(Exception)
    ├── ConfigError(ValueError)            a constructor or call argument is invalid
    │   └── ArgumentNameError(TypeError)   a keyword the call does not take (misspelled?)
    ├── UnstorableValueError(TypeError)    a value in `state` cannot be stored (save time)
    ├── StorageError(OSError)              reading or writing storage failed
    │   ├── CheckpointExistsError(FileExistsError)  the step is already committed
    │   ├── MissingFileError(FileNotFoundError)     a file that should be there is not
    │   ├── MemoryTierFullError            a step does not fit in the node's shared memory
    │   └── NotAFileError                  something else stands where a file should be
    │                                      (a FIFO, socket, device, directory, link): damage
    ├── CorruptCheckpointError             a file's size/checksum/structure is wrong
    │   └── UntrustedCheckpointError       a verify key refuses the step (signature, digests)
    ├── IncompatibleCheckpointError        the checkpoint does not fit this run
    │   │                                  (world size, keys, shapes, devices)
    │   └── ElasticResumeError             world_size_policy="elastic" cannot continue an entry
    │                                      at the new world size (names it and what to do)
    ├── CoordinationError(RuntimeError)    a rank failed, disagreed or timed out;
    │   │                                  raised identically on every rank
    │   └── RankDisagreementError          ranks hold different step/epoch/digest
    ├── FencedError                        a newer incarnation of the job holds the lease;
    │                                      this one may no longer commit
    ├── RunConflictError                   a writer that never loaded saves into a root
    │                                      holding another run's commits
    └── AsyncSaveError(RuntimeError)       a background save failed (surfaced at the
                                           next save/wait/close, on every rank)

Every warning derives from :class:`DistCkptWarning` (a ``UserWarning``), so one
``warnings.filterwarnings("error", category=distckpt.DistCkptWarning)`` catches them all; each is
raised with a ``stacklevel`` that points at the user's own call::

    DistCkptWarning(UserWarning)
    ├── CheckpointWarning                  something in a load deserves attention (extra entries, config)
    │   └── ReplayWarning                  a loader's epoch may not be replayed exactly
    ├── CheckpointFallbackWarning          the newest checkpoint was damaged; an older one was loaded
    │   └── ReshardWarning                 only part of the state was restored exactly (another world size)
    ├── DurableUploadWarning               a locally committed step is not durable (yet)
    ├── NonAtomicStorageWarning            the storage cannot create a file exclusively
    ├── RngRestoreWarning                  a random stream could not be restored exactly on this rank
    └── DeviceAbsentWarning                tensors saved on an absent accelerator came back on the CPU
"""

from __future__ import annotations

import logging
import sys
import types
import warnings


class DistCkptError(Exception):
    """Root of every error distckpt raises on purpose."""


class ConfigError(DistCkptError, ValueError):
    """An argument is invalid; the message names the field and the reason."""


class UnstorableValueError(DistCkptError, TypeError):
    """A value in `state` is neither a tensor nor a plain value; names its key path."""


class StateArgumentError(ConfigError, UnstorableValueError):
    """`state` itself is not a dict of entries: a bad argument (ConfigError) and nothing that
    could be stored (UnstorableValueError), so code catching either sees it."""


class ArgumentNameError(ConfigError, TypeError):
    """A call with an argument it does not take (a misspelled keyword, one too many, a missing
    one): a ConfigError naming it, and the TypeError Python raises for it, so code catching
    either sees it."""


class StorageError(DistCkptError, OSError):
    """Reading or writing the storage failed."""


class CheckpointExistsError(StorageError, FileExistsError):
    """A committed checkpoint already exists for this step."""


class MissingFileError(StorageError, FileNotFoundError):
    """A file the checkpoint names is not in storage."""


class MemoryTierFullError(StorageError):
    """A step does not fit in the free shared memory of a node (memory_tier=True); the message
    names the sizes. Nothing was written to memory; the step stays committed where it was saved."""


class NotAFileError(StorageError):
    """Something other than a regular file stands where a checkpoint file goes: a FIFO, a socket,
    a device node, a directory, or a symbolic link (to anything). No save makes one, so it is
    damage, found without opening it (a FIFO's open() waits for a writer forever; a device may
    read without end). Readers of a checkpoint count its step as damaged."""


class CorruptCheckpointError(DistCkptError):
    """A checkpoint file is missing, truncated, or fails its checksum or structure check."""


class NotCommittedError(CorruptCheckpointError):
    """A step directory without a commit marker: a save that never committed (or a checkpoint
    removed meanwhile). The loader skips it silently; it is not damage."""


class SupersededCheckpointError(CorruptCheckpointError):
    """A step committed by a superseded writer (fencing.py): intact, but after a newer incarnation
    took over from an earlier step. Never preferred; loaded only as the last resort, with a warning,
    when no other committed step verifies."""


class UntrustedCheckpointError(CorruptCheckpointError):
    """A manager, tool or reader given a verify key refuses a step: its SIGNATURE is missing,
    unreadable, by another key or invalid, or a file does not match the signed manifest's digest.
    A CorruptCheckpointError, so a load falls back to an older step that verifies."""


class IncompatibleCheckpointError(DistCkptError):
    """The checkpoint is intact but does not fit the state it is loaded into."""


class ElasticResumeError(IncompatibleCheckpointError):
    """world_size_policy="elastic" at another world size cannot continue an entry exactly (a
    sampler without a global order, a per_rank value without reshard=): named, with what to do."""


class CoordinationError(DistCkptError, RuntimeError):
    """A rank failed, disagreed or timed out; every rank raises the same message."""


class RankDisagreementError(CoordinationError):
    """Ranks hold different (step, epoch, manifest digest)."""


class FencedError(DistCkptError):
    """A newer incarnation of the job took the write lease; this (stale) one may not commit."""


class RunConflictError(DistCkptError):
    """A manager that never loaded tried its first save into a root holding another run's
    commits; load_latest() first, or use another directory."""


class AsyncSaveError(DistCkptError, RuntimeError):
    """A background save failed; surfaced on every rank at the next save/wait/close."""


class SnapshotChangedError(DistCkptError, RuntimeError):
    """With overlap_snapshot: a tensor was changed in place while the writer thread copied it
    (by something other than an optimizer in `state`, whose step waits for the copy). The save
    is not committed; raised on every rank, inside AsyncSaveError, at the next save/wait/close."""


SHOWN_CHARS = 120  # an argument's repr in a message: a 10**400 metric or a megabyte URL said in full buried the message


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """repr(value) for an error message, its middle elided past `limit` characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    keep = (limit - 30) // 2
    return f"{text[:keep]}…<{len(text) - 2 * keep:,} characters>…{text[-keep:]}"


# Warnings: one root, so a single filter catches every warning distckpt gives.


class DistCkptWarning(UserWarning):
    """Root of every warning distckpt gives."""


class CheckpointWarning(DistCkptWarning):
    """Something in a load deserves attention but did not stop it (extra entries, config)."""


class ReplayWarning(CheckpointWarning):
    """A loader's epoch may not be replayed exactly on resume (its start was not seen)."""


class CheckpointFallbackWarning(DistCkptWarning):
    """The newest committed checkpoint was damaged; an older one was loaded instead."""


class ReshardWarning(CheckpointFallbackWarning):
    """A load restored only part of the state exactly: a checkpoint of another world size
    (world_size_policy="reshard") or an import with no per-rank state. A CheckpointFallbackWarning
    (what it was before it had a class of its own), so filters on that class still see it."""


class DurableUploadWarning(DistCkptWarning):
    """A checkpoint committed on the local tier could not be made durable (yet)."""


class NonAtomicStorageWarning(DistCkptWarning):
    """The storage cannot create a file exclusively: two writers of one step could both commit."""


class RngRestoreWarning(DistCkptWarning):
    """A random stream in the checkpoint could not be restored exactly on this rank."""


class DeviceAbsentWarning(DistCkptWarning):
    """Tensors saved on an accelerator this process does not have came back on the CPU."""


# Telling the user: warnings that point at their own line, and one-line notices.

# Standard-library frames between a distckpt frame and the user's (a context manager's __exit__,
# a decorator's wrapper): never the user's line.
_PASSED_THROUGH = ("contextlib", "functools")


def warn(message: str, category: type[Warning]) -> None:
    """warnings.warn(message, category) reported at the user's call: the first frame outside the
    distckpt package, however deep the library raised it (a fixed stacklevel pointed into
    manager.py whenever the call path changed). With logging configured (a handler on the
    "distckpt" logger or above), the message is logged at WARNING too; without, it is not,
    since logging's last-resort handler printed every such message a second time."""
    warnings.warn(message, category, stacklevel=_user_stacklevel())
    logger = logging.getLogger("distckpt")
    if logger.hasHandlers():
        logger.warning(message)


def _user_stacklevel() -> int:
    """The stacklevel, for warnings.warn called from warn(), of the first frame outside distckpt;
    2 (warn's caller) when no frame is the user's (a thread the library started)."""
    frame: types.FrameType | None = sys._getframe(2)  # warn's caller
    level = 2
    while frame is not None and _is_library_frame(frame):
        frame = frame.f_back
        level += 1
    if frame is None or frame.f_globals.get("__name__") == "threading":
        return 2
    return level


def _is_library_frame(frame: types.FrameType) -> bool:
    module = frame.f_globals.get("__name__", "")
    return module == "distckpt" or module.startswith("distckpt.") or module in _PASSED_THROUGH


def notice(message: str) -> None:
    """One line for the person running the job (a resume, a fresh start). Through the "distckpt"
    logger at INFO when the program configured logging (a handler on that logger or above), so it
    lands where the rest of its log goes; else on stderr, since logging unconfigured shows nothing
    below WARNING and the line would never be seen. Silenced by
    ``logging.getLogger("distckpt").setLevel(logging.WARNING)``."""
    logger = logging.getLogger("distckpt")
    if logger.hasHandlers():
        logger.info(message)
    elif logger.level <= logging.INFO:  # NOTSET (0) unless the user set it
        print(f"distckpt: {message}", file=sys.stderr, flush=True)

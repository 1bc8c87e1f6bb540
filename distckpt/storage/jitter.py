"""Keeping storage clients' retry jitter off the process's global `random` stream.

botocore's retry backoff (standard and legacy modes), gcsfs's retries and azure-core's token
refresh draw their jitter from Python's global `random` module: one S3 503 retried inside a
save moved `random.getstate()`, so the run that went on and a run resumed from that very
checkpoint drew different numbers afterwards (and a failed load left the stream moved). The
draws happen on the clients' own threads, so saving and restoring the global state around a
call would race with the training thread's draws. Instead, the modules that draw (a backend's
spec names them: its jitter_modules, registry.py) are pointed at a private generator when
distckpt opens that backend: the jitter keeps its distribution, and only distckpt's choice of
generator changes, for every client of that library in the process (no one's checkpoint wants a
retry to move its stream).
"""

from __future__ import annotations

import importlib
import logging
import random
from typing import Any, Callable, Iterable

log = logging.getLogger("distckpt")

_PRIVATE = random.Random()


def keep_jitter_private(modules: Iterable[str]) -> None:
    """Point the retry jitter of `modules` (a backend's spec names them: registry.py) at a private
    generator (idempotent; a module not installed is passed over)."""
    for name in modules:
        module = _imported(name)
        if module is not None and getattr(module, "random", None) is random:
            module.random = _PRIVATE
        if name in _BOUND_DEFAULTS and module is not None:
            _BOUND_DEFAULTS[name]()


def _botocore_standard_backoff() -> None:
    """botocore.retries.standard.ExponentialBackoff took `random=random.random` as a default
    argument, bound when botocore was imported: rebinding the module name does not reach it."""
    standard = _imported("botocore.retries.standard")
    init = getattr(getattr(standard, "ExponentialBackoff", None), "__init__", None)
    code, defaults = getattr(init, "__code__", None), getattr(init, "__defaults__", None)
    if code is None or not defaults:
        return
    names = code.co_varnames[:code.co_argcount]
    first_default = len(names) - len(defaults)
    if "random" not in names or names.index("random") < first_default:
        log.debug("botocore's ExponentialBackoff has no `random` default here; its jitter stays on the global stream")
        return
    at = names.index("random") - first_default
    if defaults[at] is random.random:
        init.__defaults__ = defaults[:at] + (_PRIVATE.random,) + defaults[at + 1:]  # type: ignore[union-attr]


def _imported(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# Modules that bind the global generator where rebinding their `random` does not reach it.
_BOUND_DEFAULTS: dict[str, Callable[[], None]] = {"botocore.retries.standard": _botocore_standard_backoff}

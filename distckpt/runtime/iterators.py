"""Every data loader iterator the process makes, remembered weakly from the moment tracking is on.

A save tells a loop's loader left out of `state` and an evaluation loader whose persistent workers
drew their base seed from torch's global stream (state/loader_hazards.py) by looking at these
iterators, not by a scan of every object in the process (the collector's ~200,000 objects: 25-250
ms at a fresh process's first saves). An iterator made before tracking began is invisible to that
check, so tracking starts as early as distckpt is handed the process: `init_distributed()` (before
loaders are built, in the documented loop), `with_worker_rng()`, the framework adaptors' entry points
(which call `init_distributed`), and at the latest the first `CheckpointManager`. Accelerate's
`prepare` of a torchdata loader with persistent workers makes its iterator at once; made before the
manager, it escaped the check.

This module never touches storage, torch.distributed or the layers above.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_ITERATORS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every data loader iterator made since tracking began


def track_iterators() -> None:
    """From now on, remember every data loader iterator made (weakly), and whether its workers' base
    seed came from torch's global stream (`_distckpt_seeded_globally`). Installed once; idempotent."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    original = _BaseDataLoaderIter.__init__
    if getattr(original, "_distckpt_tracking", False):
        return

    def init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        original(self, loader, *args, **kwargs)
        try:
            _ITERATORS.add(self)
        except TypeError:  # an iterator class that takes no weak reference
            pass
        generator = getattr(loader, "generator", None)
        self._distckpt_seeded_globally = generator is None or generator is torch.default_generator

    init._distckpt_tracking = True  # type: ignore[attr-defined]
    _BaseDataLoaderIter.__init__ = init  # type: ignore[method-assign]


def tracked_iterators() -> list[Any]:
    """The data loader iterators alive that were made since tracking began."""
    return list(_ITERATORS)

"""Hugging Face Accelerate: an Accelerator set up so that its objects resume exactly.

What a user writes::

    from distckpt.integrations import accelerate as dca

    accelerator = dca.make_accelerator(gradient_accumulation_steps=2)      # instead of Accelerator(...)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}

`make_accelerator` does three things a plain `Accelerator()` under torchrun does not:

* it starts the process group with `distckpt.init_distributed()` before Accelerate looks for one
  (a group Accelerate starts itself through torchrun's agent store did not come up again after a
  torchrun restart: "Gloo connectFullMesh failed ... Connection refused");
* on a host without GPUs it passes `cpu=True` (without it Accelerate counts one process and every
  rank trains its own copy alone; the manager refuses such a job at its first save or load);
* it backs prepared loaders with torchdata's StatefulDataLoader (`use_stateful_dataloader=True`),
  whose position a checkpoint holds. The prepared loader (`DataLoaderShard`) goes in `state` as it
  is: distckpt saves its position, the batch it holds ahead of the loop, its epoch count, and the
  streams of the loader under it.

The optimizer `accelerator.prepare()` returns works with every manager option, overlap_snapshot
and `distckpt doctor --every` included. Save where `accelerator.sync_gradients` is True (after an
optimizer step): Accelerate's count of accumulated batches is in no state and starts at 0 again.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from distckpt.errors import ConfigError
from distckpt.integrations import require
from distckpt.protocol.frameworks import accelerate_processes
from distckpt.runtime.dist import init_distributed

__all__ = ["check_world", "make_accelerator"]


def make_accelerator(*, timeout: float | timedelta = 600.0, **kwargs: Any) -> Any:
    """An `accelerate.Accelerator(**kwargs)` on a process group started by
    `distckpt.init_distributed(timeout=timeout)` (call on every rank, as Accelerator() itself).

    Unless given: `cpu=True` where this rank has no GPU and the world has more than one process,
    and `dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)`. Raises
    ConfigError if Accelerate is not installed, or if it then counts another world than torchrun's.
    """
    accelerate = require("accelerate", "accelerate", "distckpt.integrations.accelerate")
    utils = require("accelerate.utils", "accelerate", "distckpt.integrations.accelerate")
    info = init_distributed(timeout=timeout)
    if "cpu" not in kwargs and info.world_size > 1 and info.device.type == "cpu":
        kwargs["cpu"] = True  # else Accelerate counts one process: each rank would train alone
    if "dataloader_config" not in kwargs:
        kwargs["dataloader_config"] = utils.DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = accelerate.Accelerator(**kwargs)
    check_world(info.world_size)
    return accelerator


def check_world(world_size: int | None = None) -> None:
    """ConfigError if Accelerate counts another number of processes than the job's world
    (`world_size`, or torch.distributed's). The manager checks this at every save and load of a
    `state` holding prepared objects; call it to find out at once."""
    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    seen = accelerate_processes()
    if seen is not None and seen != world_size:
        raise ConfigError(
            f"Hugging Face Accelerate sees {seen} process(es) and this job has a world of {world_size}: each rank "
            "would train its own copy alone. On a host without GPUs pass cpu=True (or set ACCELERATE_USE_CPU=1), "
            "or build the Accelerator with distckpt.integrations.accelerate.make_accelerator()")

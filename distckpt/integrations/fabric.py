"""Lightning Fabric: a Fabric whose process group survives a torchrun restart, and the loader a
checkpoint can resume.

What a user writes::

    from distckpt.integrations import fabric as dcf

    fabric = dcf.make_fabric(accelerator="cpu", strategy="ddp", devices=2)  # instead of Fabric(...).launch()
    model, optimizer = fabric.setup(model, optimizer)
    loader = dcf.stateful_loader(fabric, dataset, batch_size=32, num_workers=2)  # not setup_dataloaders
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "sampler": loader.sampler, "loader": loader}
    ...
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            batch = fabric.to_device(batch)

The module and optimizer `fabric.setup` returns go in `state` as they are (the module is saved as
the one it wraps). The loader stays away from `fabric.setup_dataloaders`: its wrapper sets the
sampler's epoch from its own count of passes, which restarts at 0 in a resumed process (refused in
`state`, and when the loop iterates it). Accumulate with `fabric.no_backward_sync(model,
enabled=...)` and save after an optimizer step.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from distckpt.errors import ConfigError
from distckpt.integrations import require
from distckpt.runtime.dist import init_distributed
from distckpt.state.workers import with_worker_rng

__all__ = ["make_fabric", "stateful_loader"]

_WHAT = "distckpt.integrations.fabric"


def make_fabric(*, timeout: float | timedelta = 600.0, **kwargs: Any) -> Any:
    """`lightning_fabric.Fabric(**kwargs)`, launched, on a process group started by
    `distckpt.init_distributed(timeout=timeout)` (call on every rank under torchrun). A group Fabric
    starts itself through torchrun's agent store is not restart-safe (Accelerate's failed to come up
    after a torchrun restart the same way); Fabric uses one that exists. Raises ConfigError if
    Lightning Fabric is not installed, or if Fabric then counts another world than torchrun's."""
    fabric_module = _fabric_module()
    info = init_distributed(timeout=timeout)
    fabric = fabric_module.Fabric(**kwargs)
    fabric.launch()
    if fabric.world_size != info.world_size:
        raise ConfigError(f"Fabric(**{kwargs}) counts a world of {fabric.world_size} and torchrun started "
                          f"{info.world_size} processes: give it devices= and num_nodes= that match torchrun's "
                          "--nproc-per-node and --nnodes")
    return fabric


def stateful_loader(fabric: Any, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                    **kwargs: Any) -> Any:
    """A torchdata StatefulDataLoader over `dataset` with a DistributedSampler of Fabric's world
    (`loader.sampler`: call its set_epoch at each epoch's start), the dataset wrapped in
    with_worker_rng when num_workers > 0. `kwargs` go to the loader (batch_size, num_workers,
    collate_fn, ...). Iterate it yourself and put it, and its sampler, in `state`."""
    stateful = require("torchdata.stateful_dataloader", "torchdata", _WHAT).StatefulDataLoader
    from torch.utils.data.distributed import DistributedSampler

    if "sampler" in kwargs or "batch_sampler" in kwargs:
        raise ConfigError("stateful_loader(sampler=/batch_sampler=): it makes the DistributedSampler itself; build "
                          "a StatefulDataLoader over your sampler instead")
    if kwargs.get("num_workers", 0) > 0:
        dataset = with_worker_rng(dataset)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=shuffle, seed=seed,
        drop_last=drop_last)
    return stateful(dataset, sampler=sampler, **kwargs)


def _fabric_module() -> Any:
    try:
        return require("lightning_fabric", "lightning-fabric", _WHAT)
    except ConfigError:
        return require("lightning.fabric", "lightning-fabric", _WHAT)

"""timm's training script (`train.py`): its loader and its scheduler, saved so that they resume exactly.

What a user writes::

    from distckpt.integrations import timm as dct

    loader_train = dct.create_loader(dataset_train, ...)   # timm.data.create_loader's arguments
    loader_eval = dct.create_loader(dataset_eval, ...)     # the evaluation loader too (see below)
    state = {"model": model, "optimizer": optimizer, "ema": model_ema, "loader": loader_train,
             "scheduler": dct.scheduler_state(lr_scheduler), "eval_loader": loader_eval}

`create_loader` builds what timm's `create_loader` builds (transforms, sampler, collate, worker
seeding, prefetcher) over a torchdata StatefulDataLoader, whose position a checkpoint holds, with
the dataset wrapped in `distckpt.with_worker_rng` when there are workers (RandAugment, random
crops and flips draw in them). With the prefetcher (timm's default) it returns a `PrefetchLoader`:
timm's, which holds the next batch on the device (normalized, random erasing applied) while the
loop trains on the current one, that tells distckpt which batch it holds; the checkpoint keeps that
batch and the resumed run gives it first (a resume through timm's own prefetcher skipped it).

`scheduler_state(scheduler)` saves a timm scheduler per rank: `step_update(..., metric=...)` keeps
each rank's own running loss as `.metric`, which a replicated entry refuses at the first save.

The evaluation loader: timm's has persistent workers, which draw their base seed from torch's
global stream at the loader's first pass only. Left out of `state`, a resumed run draws that seed
again at its first evaluation, and torch's stream is a draw off from then on (drop path, mixup):
put it in `state` (its position at a save between evaluations is the start of a pass), or build it
with a generator of its own. The save says so if it finds one left out.
"""

from __future__ import annotations

from contextlib import suppress
from functools import partial
from typing import Any

import torch

from distckpt.errors import ConfigError
from distckpt.integrations import require
from distckpt.state.capture import PerRank, per_rank
from distckpt.state.workers import with_worker_rng

__all__ = ["PrefetchLoader", "create_loader", "scheduler_state", "stateful_loader"]

_WHAT = "distckpt.integrations.timm"


def create_loader(dataset: Any, **kwargs: Any) -> Any:
    """`timm.data.create_loader(dataset, **kwargs)` over a torchdata StatefulDataLoader: that
    loader, or (use_prefetcher=True, timm's default) a PrefetchLoader over it. Put what it returns
    in `state`. use_multi_epochs_loader=True is refused (its iterator outlives every pass: no
    position of a pass to save)."""
    timm_loader = require("timm.data.loader", "timm", _WHAT)
    if kwargs.get("use_multi_epochs_loader"):
        raise ConfigError("create_loader(use_multi_epochs_loader=True): its one iterator spans every epoch, so no "
                          "pass has a position to save; leave it False (persistent_workers keeps the workers)")
    built = timm_loader.create_loader(dataset, **kwargs)
    if not kwargs.get("use_prefetcher", True):
        return stateful_loader(built)
    return PrefetchLoader.over(built, stateful_loader(built.loader))


def stateful_loader(loader: torch.utils.data.DataLoader) -> Any:
    """A torchdata StatefulDataLoader built as `loader` is (dataset, sampler, batching, collate,
    workers, their seeding), its dataset wrapped in with_worker_rng when it has workers."""
    stateful = require("torchdata.stateful_dataloader", "torchdata", _WHAT).StatefulDataLoader
    dataset = loader.dataset
    options: dict[str, Any] = {"num_workers": loader.num_workers, "collate_fn": loader.collate_fn,
                               "pin_memory": loader.pin_memory, "worker_init_fn": loader.worker_init_fn,
                               "persistent_workers": loader.persistent_workers, "generator": loader.generator,
                               "timeout": loader.timeout}
    if loader.num_workers > 0:
        dataset = with_worker_rng(dataset)
        options["prefetch_factor"] = loader.prefetch_factor
    sampler = loader.sampler
    if type(loader.batch_sampler) is not torch.utils.data.BatchSampler:  # a batch sampler of its own
        options["batch_sampler"] = loader.batch_sampler
    else:
        options.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
        if type(sampler) is torch.utils.data.RandomSampler and sampler.generator is None:
            options["shuffle"] = True  # torchdata's own RandomSampler, whose position it saves
        elif type(sampler) is not torch.utils.data.SequentialSampler:
            options["sampler"] = sampler
    return stateful(dataset, **options)


def scheduler_state(scheduler: Any) -> PerRank:
    """A timm scheduler as a `state` entry: per rank, since it keeps each rank's own metric."""
    if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
        raise ConfigError(f"scheduler_state({type(scheduler).__name__}): not a scheduler with state_dict and "
                          "load_state_dict (timm.scheduler's have both)")
    return per_rank(scheduler)


class PrefetchLoader:
    """timm's PrefetchLoader (a subclass of it, made when first used: timm need not be installed to
    import this module) that tells distckpt the batch it holds ahead of the loop and gives a
    restored one first (the prefetching-loader protocol of distckpt.state.kinds.prefetching)."""

    _made: type | None = None

    def __new__(cls, loader: Any, *args: Any, **kwargs: Any) -> Any:
        made = cls._subclass()
        return made(loader, *args, **kwargs)

    @classmethod
    def over(cls, timm_prefetcher: Any, loader: Any) -> Any:
        """This prefetcher over `loader`, set up as `timm_prefetcher` is (normalization, device,
        dtype, random erasing)."""
        made: Any = cls._subclass()
        prefetcher = object.__new__(made)  # set up below as timm's was, not by its __init__
        vars(prefetcher).update(vars(timm_prefetcher))
        prefetcher.loader = loader
        prefetcher._distckpt_reset()
        return prefetcher

    @classmethod
    def _subclass(cls) -> type:
        if cls._made is None:
            base = require("timm.data.loader", "timm", _WHAT).PrefetchLoader
            cls._made = type("PrefetchLoader", (_HeldBatches, base), {"__module__": __name__})
        return cls._made


class _HeldBatches:
    """timm's PrefetchLoader.__iter__, keeping the batch it holds where distckpt can read it."""

    loader: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._distckpt_reset()

    def _distckpt_reset(self) -> None:
        self._held: list[Any] = []
        self._ending = False
        self._give: list[Any] = []
        self._end_at_once = False

    # -- the prefetching-loader protocol --------------------------------------------------------

    def distckpt_held_batches(self) -> list[Any]:
        return list(self._give) if self._give else list(self._held)

    def distckpt_pass_ending(self) -> bool:
        return self._end_at_once or self._ending

    def distckpt_give_first(self, batches: list[Any], end_pass: bool = False) -> None:
        self._give, self._end_at_once = [tuple(b) if isinstance(b, list) else b for b in batches], end_pass

    # -- timm's loop, the held batch kept on self -----------------------------------------------

    def __iter__(self) -> Any:
        self._held, self._ending = [], False
        if self._end_at_once:  # the saved pass had given its last batch: it ends here, as it did
            self._end_at_once = False
            return
        given, self._give = self._give, []
        first = not given
        if given:
            input, target = given[0]
            self._held = [given[0]]
        stream_context, consumer_stream, device_mod = self._distckpt_streams()
        for next_input, next_target in self.loader:
            if consumer_stream is not None:
                self.stream.wait_stream(consumer_stream)  # type: ignore[attr-defined]
            with stream_context():
                next_input = next_input.to(device=self.device, non_blocking=True)  # type: ignore[attr-defined]
                next_target = next_target.to(device=self.device, non_blocking=True)  # type: ignore[attr-defined]
                next_input = next_input.to(self.img_dtype).sub_(self.mean).div_(self.std)  # type: ignore[attr-defined]
                if self.random_erasing is not None:  # type: ignore[attr-defined]
                    next_input = self.random_erasing(next_input)  # type: ignore[attr-defined]
            if not first:
                self._held = [(next_input, next_target)]  # held while the loop works on the one before
                yield input, target
            else:
                first = False
            if consumer_stream is not None:
                consumer_stream = device_mod.current_stream(device=self.device)  # type: ignore[attr-defined]
                consumer_stream.wait_stream(self.stream)  # type: ignore[attr-defined]
            input, target = next_input, next_target
        self._held = []
        if not first:
            self._ending = True
            yield input, target
            self._ending = False

    def _distckpt_streams(self) -> tuple[Any, Any, Any]:
        device_mod = torch.cuda if getattr(self, "is_cuda", False) else None
        if device_mod is None and getattr(self, "is_npu", False):
            device_mod = torch.npu  # type: ignore[attr-defined]
        if device_mod is None:
            return suppress, None, None
        if getattr(self, "stream", None) is None:
            self.stream = device_mod.Stream(device=self.device)  # type: ignore[attr-defined]
        return (partial(device_mod.stream, stream=self.stream), device_mod.current_stream(device=self.device),  # type: ignore[attr-defined]
                device_mod)

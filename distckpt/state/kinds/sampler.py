"""A sampler in `state` (DistributedSampler, RandomSampler, a BatchSampler over one, a sampler
with state_dict): its epoch, seed and generator, per rank."""

from __future__ import annotations

import copy
from typing import Any

import torch

from distckpt.errors import ElasticResumeError, IncompatibleCheckpointError
from distckpt.state.capture import PER_RANK, Entry, Release, _has_state_dict
from distckpt.state.kinds.base import Differing, Job, Kind, Trait, World, shown
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules


class Sampler(Kind):
    """A torch.utils.data.Sampler: its state_dict when it has one, else its epoch, seed and
    settings (DistributedSampler), its generator and the sampler inside (BatchSampler)."""

    name, scope = "sampler", PER_RANK
    description = "a sampler: its epoch, seed and generator (or its state_dict), per rank"

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.Sampler)

    def capture(self, entry: Entry) -> Any:
        return _capture(entry.target)

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        _check(entry.target, saved, where)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        _restore(entry.target, value)
        return []

    def elastic(self, entry: Entry, saved: list[Any], context: Any) -> Any:
        """A DistributedSampler at the new world size: the epoch and seed every old rank agreed
        on, this rank's num_replicas and rank (the epoch's rest is the loader's: elastic.py)."""
        target = entry.target
        if type(target) is not torch.utils.data.DistributedSampler:
            raise ElasticResumeError(
                f"state[{entry.key!r}] is a {type(target).__name__}: world_size_policy='elastic' continues a "
                "torch.utils.data.DistributedSampler only (it defines one order across ranks); use one, or load with "
                "world_size_policy='reshard' to restart the epoch (docs: guides/elastic.md)")
        views = {(s.get("epoch"), s.get("seed")) if isinstance(s, dict) else None for s in saved}
        if len(views) != 1 or None in views:
            raise ElasticResumeError(f"state[{entry.key!r}]: the old ranks' samplers were saved in different epochs "
                                     f"or with different seeds ({sorted(map(str, views))}): no one order to continue")
        return {**saved[0], "num_replicas": target.num_replicas, "rank": target.rank}

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        target = entry.target
        if callable(getattr(target, "state_dict", None)):
            sd = copy.deepcopy(target.state_dict())
            return lambda: target.load_state_dict(sd)
        plain = _capture(target)
        return lambda: _restore(target, plain)

    def summary(self, state: Any) -> dict[str, Any]:
        if not isinstance(state, dict):
            return {}
        out = {k: state[k] for k in ("type", "epoch", "seed", "num_replicas", "rank") if k in state}
        if "state_dict" in state:
            out["state_dict"] = shown(state["state_dict"])
        return out

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset({Trait.SAMPLING_ORDER})

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        if not any(d.path.endswith("epoch") for d in differing):
            return []
        if job.known and not job.holds(Trait.DATA_POSITION):
            return ["the sampler's epoch differs and no data loader is in `state` → the resumed run started the "
                    "saved epoch over (its position inside the epoch is lost), so its steps fell in other epochs "
                    "than the uninterrupted run's: put the loader (a torchdata StatefulDataLoader) in `state` "
                    "(docs: guides/loop-rules.md, keep the loader in `state`)"]
        return ["the sampler's epoch differs → call sampler.set_epoch(epoch) at every epoch start "
                "(and pass epoch= to save)"]


_GENERATOR = "generator"  # a sampler's own torch.Generator, in its saved state


def _capture(sampler: Any) -> dict[str, Any]:
    if _has_state_dict(sampler):
        return {"type": type(sampler).__name__, "state_dict": sampler.state_dict()}
    out: dict[str, Any] = {"type": type(sampler).__name__}
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        out.update(epoch=sampler.epoch, seed=sampler.seed, shuffle=sampler.shuffle,
                   drop_last=sampler.drop_last, num_replicas=sampler.num_replicas, rank=sampler.rank)
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        out[_GENERATOR] = generator.get_state()
    inner = getattr(sampler, "sampler", None)  # BatchSampler and friends
    if isinstance(inner, torch.utils.data.Sampler):
        out["inner"] = _capture(inner)
    return out


def _check(sampler: Any, saved: dict[str, Any], where: str) -> None:
    if saved.get("type") != type(sampler).__name__:
        raise IncompatibleCheckpointError(
            f"{where} is a {type(sampler).__name__} but the checkpoint holds a {saved.get('type')}")
    if "num_replicas" in saved and (saved["num_replicas"], saved["rank"]) != (sampler.num_replicas, sampler.rank):
        raise IncompatibleCheckpointError(
            f"{where}: DistributedSampler was saved as rank {saved['rank']} of {saved['num_replicas']} "
            f"but is rank {sampler.rank} of {sampler.num_replicas} here")
    if "state_dict" in saved:
        return
    has_generator = isinstance(getattr(sampler, "generator", None), torch.Generator)
    if has_generator != (_GENERATOR in saved):
        raise IncompatibleCheckpointError(
            f"{where}: the sampler {'has' if has_generator else 'has no'} generator here but "
            f"{'had one' if _GENERATOR in saved else 'had none'} in the run that saved; build it the same way")
    inner = getattr(sampler, "sampler", None)
    if "inner" in saved:
        if not isinstance(inner, torch.utils.data.Sampler):
            raise IncompatibleCheckpointError(f"{where}: the checkpoint holds an inner sampler, this sampler has none")
        _check(inner, saved["inner"], f"{where}.sampler")


def _restore(sampler: Any, saved: dict[str, Any]) -> None:
    if "state_dict" in saved:
        sampler.load_state_dict(saved["state_dict"])
        return
    if "epoch" in saved:
        sampler.set_epoch(saved["epoch"])
        sampler.seed = saved["seed"]
    if _GENERATOR in saved:
        sampler.generator.set_state(saved[_GENERATOR])
    if "inner" in saved:
        _restore(sampler.sampler, saved["inner"])

"""Anything else with state_dict / load_state_dict: optimizers, LR schedulers, gradient scalers,
the user's own objects. Replicated unless per_rank(); compared across ranks at each save (but
an optimizer, which DDP keeps equal and which is as large as the model)."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from distckpt.state import undo, validation
from distckpt.state.capture import Entry, Release, _has_state_dict
from distckpt.state.kinds.base import Differing, Job, Kind, Trait, World
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules


class Stateful(Kind):
    """Anything with state_dict / load_state_dict: optimizers, schedulers, scalers, users' objects."""

    name = "stateful"
    description = "anything with state_dict/load_state_dict: optimizers, LR schedulers, scalers, your objects"
    generic = handed_over = True

    def matches(self, key: str, obj: Any) -> bool:
        return _has_state_dict(obj)

    def capture(self, entry: Entry) -> Any:
        return entry.target.state_dict()

    def compared_value(self, entry: Entry) -> Any:
        return entry.target.state_dict()  # what it saves: a ReduceLROnPlateau stepped on each rank's own loss differs

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._optimizer(entry.target, saved, where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        if isinstance(entry.target, torch.optim.Optimizer):
            value = _with_param_id_sets(value)
        entry.target.load_state_dict(value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        if isinstance(entry.target, torch.optim.Optimizer):
            return undo.optimizer_undo(entry.target)
        saved = copy.deepcopy(entry.target.state_dict())
        return lambda: entry.target.load_state_dict(saved)

    def staged_tensors(self, entry: Entry) -> list[Any]:
        return optimizer_state_tensors(entry.target)

    def shown_as(self, record: dict[str, Any]) -> str:
        if is_optimizer_record(record):
            return "optimizer"
        return "scheduler" if is_lr_schedule(record.get("state")) else self.name

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        if is_optimizer_record(record):
            return frozenset({Trait.OPTIMIZER})
        return frozenset({Trait.LR_SCHEDULE}) if is_lr_schedule(record.get("state")) else frozenset()

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        causes = []
        if any(Trait.LR_SCHEDULE in job.differing.get(d.key, ()) for d in differing):
            causes.append("the LR scheduler's state differs → it was stepped a different number of times after the "
                          "resume (a step counter not restored), or it is not in `state`")
        return causes + learning_rate_causes(differing, job)


def is_optimizer_record(record: dict[str, Any]) -> bool:
    """A torch.optim optimizer's record: saved with its class name (its state_dict does not say)."""
    return isinstance(record.get("type"), str)


def is_lr_schedule(state: Any) -> bool:
    """A torch LR scheduler's state_dict (every one keeps its last epoch and its last rates; the
    classic ones their base rates)."""
    return (isinstance(state, dict) and isinstance(state.get("last_epoch"), int)
            and ("base_lrs" in state or "_last_lr" in state))


_LEARNING_RATE = re.compile(r"param_groups/\d+/(lr|initial_lr)$")


def learning_rate_causes(differing: list[Differing], job: Job) -> list[str]:
    """An optimizer's learning rate differs and no LR schedule does: the schedule did not resume."""
    optimizers = [d for d in differing if Trait.OPTIMIZER in job.differing.get(d.key, ())]
    if job.differs_in(Trait.LR_SCHEDULE) or not any(_LEARNING_RATE.search(d.path) for d in optimizers):
        return []
    return ["the optimizer's learning rate differs → the learning-rate schedule did not resume: is the "
            "LR scheduler in `state` (and stepped at the same points after a resume)?"]


def optimizer_state_tensors(target: Any) -> list[Any]:
    """An optimizer's per-parameter state (moments, steps), as an async save stages it."""
    if not isinstance(target, torch.optim.Optimizer):
        return []
    return [value for per_parameter in target.state.values() for value in per_parameter.values()]


class _ParamIds(list):  # type: ignore[type-arg]
    """A param group's saved parameter ids whose `in` is a set lookup. Optimizer.load_state_dict
    asks `param_id in group["params"]` of every saved group for every state tensor: a list scan,
    quadratic in the parameters (4.0 of a 6.1 s load of 20,000 parameters with AdamW; 0.1 s
    after). It deep-copies the groups and then replaces "params" by the optimizer's own list, so
    nothing of this class outlives the load."""

    def __contains__(self, item: object) -> bool:
        cached = self.__dict__.get("_ids")
        if cached is None or cached[0] != len(self):  # (re)built once the list holds its items
            hashable = all(isinstance(i, (int, str)) for i in self)
            cached = self.__dict__["_ids"] = (len(self), frozenset(self) if hashable else None)
        ids = cached[1]
        try:
            return list.__contains__(self, item) if ids is None else item in ids
        except TypeError:  # an unhashable item asked about: no id equals it
            return list.__contains__(self, item)


def _with_param_id_sets(saved: Any) -> Any:
    """`saved` (an optimizer's state dict) with each param group's "params" a _ParamIds."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return saved
    groups = [{**g, "params": _ParamIds(g["params"])}
              if isinstance(g, dict) and type(g.get("params")) is list else g
              for g in saved["param_groups"]]
    return {**saved, "param_groups": groups}

"""An `nn.Module` in `state` (bare, DDP, DataParallel, compiled, Lightning Fabric's): its
state_dict, every submodule's `training` flag and every parameter's `requires_grad`."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from distckpt.errors import IncompatibleCheckpointError
from distckpt.state import undo, validation
from distckpt.state.capture import Entry, Release, _capture_module, _restore_module, has_own_load_logic, unwrap_module
from distckpt.state.ddp import install_bucket_warmup
from distckpt.state.kinds.base import Differing, Job, Kind, Trait, World
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules

NO_OPTIMIZER_CAUSE = ("no torch.optim optimizer in `state` → after a resume its moments and step count start over; "
                      "put the optimizer in `state`")


class ModuleLike(Kind):
    """What a module and a sharded module share. A module is restored late (after every rank
    restored the rest) only when its restore cannot fail: torch's own loading of a state checked
    completely before. One with load logic of its own (hooks, its own _load_from_state_dict) may
    refuse; it is restored with the early entries, its tensors copied first, so that its failure
    leaves every late entry untouched on every rank."""

    late, copies_loaded_tensors, holds_weights = True, False, True
    compared_across_ranks = False
    not_compared_because = "its parameters are sampled into the ranks' agreement instead (holds_weights)"

    def is_late(self, entry: Entry) -> bool:
        return not has_own_load_logic(unwrap_module(entry.target))

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        return undo.module_undo(unwrap_module(entry.target))

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset({Trait.WEIGHTS})

    def saved_weights(self, state: Any) -> dict[str, Any] | None:
        weights = state.get("state_dict") if isinstance(state, dict) else None
        return weights if isinstance(weights, dict) else None

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        causes = []
        if job.known and not job.holds(Trait.OPTIMIZER):
            causes.append(NO_OPTIMIZER_CAUSE)
        if any(d.path.startswith("training/") or "/training/" in d.path for d in differing):
            causes.append("a module's training flag differs → a validation pass left a submodule in eval mode "
                          "differently; put the model in state as trained and call .train() after validation")
        return causes


class Module(ModuleLike):
    """An nn.Module (bare, DDP, DataParallel or compiled): its state_dict and every submodule's
    `training` flag."""

    name = "module"
    description = "a model (nn.Module, DDP, compiled): its state_dict and training flags"

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def capture(self, entry: Entry) -> Any:
        return _capture_module(entry.target)

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._module(entry.target, saved, where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        _restore_module(unwrap_module(entry.target), value, release, f"state[{entry.key!r}]")
        return []

    def after_load(self, entry: Entry) -> None:
        install_bucket_warmup(entry.target)  # DDP's first step after a load rebuilds its buckets

    def in_place_copies(self, entry: Entry, record: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        if not isinstance(record["state"], dict):
            return
        stored = record["state"].get("state_dict") or {}
        for name, live in unwrap_module(entry.target).state_dict(keep_vars=True).items():
            if isinstance(stored.get(name), torch.Tensor) and isinstance(live, torch.Tensor):
                yield f"state[{entry.key!r}].{name}", stored[name], live

    def copy_destinations(self, entry: Entry) -> list[torch.Tensor]:
        return [t for t in unwrap_module(entry.target).state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]

    def from_imported(self, entry: Entry, state: Any) -> dict[str, Any]:
        if not isinstance(state, dict):
            raise IncompatibleCheckpointError(f"state[{entry.key!r}]: the imported entry is not a state_dict")
        return {"kind": self.name, "state": {"state_dict": state, "metadata": {}, "training": None}}

"""An optimizer over DTensor parameters: its state named by its module's parameters, each rank
writing its own pieces. Never matched alone: classify gives it to an optimizer entry whose
parameters a sharded module in `state` holds."""

from __future__ import annotations

from typing import Any

import torch

from distckpt.errors import IncompatibleCheckpointError
from distckpt.state import sharded, undo
from distckpt.state.capture import SHARDED, Entry, Release
from distckpt.state.kinds.base import Differing, Job, Kind, Trait
from distckpt.state.kinds.sharded_module import _imported_into_sharded
from distckpt.state.kinds.stateful import Stateful, learning_rate_causes, optimizer_state_tensors
from distckpt.state.undo import Undo


class ShardedOptimizer(Kind):
    """An optimizer over DTensor parameters, named by its module's parameters (given to an
    optimizer entry by `classify`, never matched alone)."""

    name, scope = "sharded_optimizer", SHARDED
    description = "an optimizer over DTensor parameters: each rank's pieces, named by its model's parameters"

    def capture(self, entry: Entry) -> Any:
        return sharded.capture_optimizer(entry.owner, entry.target)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        sharded.restore_optimizer(entry.owner, entry.target, value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        if isinstance(entry.target, torch.optim.Optimizer):
            return undo.optimizer_undo(entry.target)
        return Stateful().undo(entry, state)

    def staged_tensors(self, entry: Entry) -> list[Any]:
        return optimizer_state_tensors(entry.target)

    def loads_into(self, entry: Entry) -> Entry | None:
        """Sharded optimizer state loads into the optimizer of a sharded or a plain module, named
        through that module's parameters."""
        if not isinstance(entry.kind_spec, (Stateful, ShardedOptimizer)):
            return None
        if entry.owner is None:
            raise IncompatibleCheckpointError(
                f"state[{entry.key!r}]: the checkpoint holds a sharded optimizer, named by its model's "
                "parameters; put the model it optimizes in `state` too")
        return Entry(entry.key, SHARDED, self.name, entry.target, entry.owner)

    def resolve_shards(self, entry: Entry, saved_state: Any, reader: "sharded.ShardReader") -> Any:
        target = sharded.target_optimizer_state(entry.owner, entry.target)
        return sharded.resolve(saved_state, target, reader, (entry.key,))

    def from_imported(self, entry: Entry, state: Any) -> dict[str, Any]:
        raise _imported_into_sharded(entry)

    def shown_as(self, record: dict[str, Any]) -> str:
        return "optimizer"

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset({Trait.OPTIMIZER})

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        return learning_rate_causes(differing, job)

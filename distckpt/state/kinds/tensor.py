"""A tensor in `state` (a buffer kept beside the model, a best loss as a 0-d tensor): copied into
in place on load, checked completely first."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from distckpt.state import validation
from distckpt.state.capture import Entry, Release, copy_released
from distckpt.state.kinds.base import Kind, World
from distckpt.state.validation import LoadRules


class Tensor(Kind):
    """A tensor entry, copied into in place (checked completely first: not snapshotted)."""

    name = "tensor"
    description = "a tensor: copied into in place on load"
    generic = late = restores_by_copies_alone = replaceable_by_value = True
    copies_loaded_tensors = False

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def capture(self, entry: Entry) -> Any:
        return entry.target

    def compared_value(self, entry: Entry) -> Any:
        return entry.target  # what capture returns

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._tensor(entry.target, saved, where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        copy_released(entry.target, value, release, f"state[{entry.key!r}]")
        return []

    def in_place_copies(self, entry: Entry, record: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        if isinstance(record["state"], torch.Tensor):
            yield f"state[{entry.key!r}]", record["state"], entry.target

    def copy_destinations(self, entry: Entry) -> list[torch.Tensor]:
        return [entry.target] if isinstance(entry.target, torch.Tensor) else []

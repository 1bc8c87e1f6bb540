"""An entry of a checkpoint imported from torch.save or DCP (`distckpt import-torch`,
`import-dcp`): a tree of whatever the file held, taking the shape of the live entry's kind when
it is loaded."""

from __future__ import annotations

from typing import Any

import torch

from distckpt.state.capture import IMPORTED, Entry
from distckpt.state.kinds.base import Kind


class Imported(Kind):
    """An imported entry: its kind is the live entry's (never matched by a live object)."""

    name = IMPORTED
    description = "an entry imported from torch.save or DCP: takes the live entry's kind on load"
    compared_across_ranks = False
    not_compared_because = "never a live entry: nothing is saved of this kind"

    def as_loaded_into(self, entry: Entry, record: dict[str, Any]) -> dict[str, Any]:
        return entry.kind_spec.from_imported(entry, record.get("state"))

    def saved_weights(self, state: Any) -> dict[str, Any] | None:
        """A state_dict as it was saved (str keys, tensors only)."""
        if (isinstance(state, dict) and bool(state)
                and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())):
            return state
        return None

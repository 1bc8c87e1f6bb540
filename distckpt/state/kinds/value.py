"""Anything else: plain values and containers of them (a loop counter, a best loss, a dict of
metrics, a list). A dict or list is refilled in place; anything else is replaced under its key."""

from __future__ import annotations

from typing import Any

from distckpt.state import undo
from distckpt.state.capture import PER_RANK, Entry, PerRank, Release, _capture_plain
from distckpt.state.kinds.base import Differing, Job, Kind, Trait
from distckpt.state.undo import Undo


class Value(Kind):
    """Anything else: plain values and containers (a dict or list is refilled in place)."""

    name = "value"
    description = "plain values and containers (None, bool, int, float, str, list, tuple, dict)"
    generic = handed_over = replaceable_by_value = True
    restore_checked = True  # refilled (a dict or list of its own exact type) or replaced: nothing to refuse

    def matches(self, key: str, obj: Any) -> bool:
        return True

    def capture(self, entry: Entry) -> Any:
        return _capture_plain(entry.target)

    def compared_value(self, entry: Entry) -> Any:
        return entry.target  # the live value itself: what capture returns, without a copy

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        target = entry.target
        # Refilled in place (whoever holds the live container sees the values) only when the live
        # one is of the saved type: a plain dict refilled from a saved OrderedDict (or the reverse)
        # would not come back as what was saved.
        if type(target) is type(value) and isinstance(value, dict):
            target.clear()
            target.update(value)
        elif type(target) is type(value) and isinstance(value, list):
            target[:] = value
        else:
            live = state[entry.key]
            state[entry.key] = PerRank(value, live.reshard) if entry.scope == PER_RANK and isinstance(live, PerRank) \
                else value
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        return undo.value_undo(entry, state)

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset({Trait.PLAIN_VALUE})

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        plain = [d for d in differing if not _a_tensor(d.detail)]
        whole = sorted({f"`{d.key}`: {d.detail}" for d in plain if d.path == "state"})
        inside = [d for d in plain if d.path.startswith("state/")]
        causes = []
        if whole:
            causes.append(f"a plain value in `state` differs ({'; '.join(whole[:3])}) → a loop variable is not written "
                          "into `state` before each save, or not read back from it after the load (docs: guides/loop-patterns.md, "
                          "plain loop variables)")
        if inside:
            first = inside[0]
            causes.append(f"a value your loop keeps in `state[{first.key!r}]` differs ({first.path}: {first.detail}) → "
                          "it is not applied back after the load (to your loader, when it is a loader's position), or "
                          "it is written into `state` at another point than right before each save")
        return causes


def _a_tensor(detail: str) -> bool:
    """A difference the doctor described as a tensor's (a value holding tensors)."""
    return "elements differ" in detail or detail.startswith("tensor ")

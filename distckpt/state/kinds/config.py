"""`state["config"]`: the run's settings, compared with the resuming run's, never overwritten."""

from __future__ import annotations

from typing import Any

from distckpt.state.capture import CONFIG_KEY, Entry, Release, _capture_plain, config_differences
from distckpt.state.kinds.base import Kind, Trait


class Config(Kind):
    """`state["config"]` (plain values): compared with the resuming run's, never overwritten."""

    name = "config"
    description = "the run's settings (state['config']): compared on load, never overwritten"
    compared_across_ranks = False
    not_compared_because = "every rank compares its own settings with the saved ones on load"

    def matches(self, key: str, obj: Any) -> bool:
        return key == CONFIG_KEY and not hasattr(obj, "state_dict")

    def capture(self, entry: Entry) -> Any:
        return _capture_plain(entry.target)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        return config_differences(value, entry.target)

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset({Trait.CONFIG})

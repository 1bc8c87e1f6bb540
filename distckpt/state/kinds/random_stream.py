"""What the four kinds of random generator entries share: a private stream of streams.py, saved
per rank, tried on a scratch copy before a restore."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from distckpt.errors import CorruptCheckpointError
from distckpt.state.capture import PER_RANK, Entry, Release
from distckpt.state.elastic_rules import seeded_like
from distckpt.state.kinds.base import Kind, Trait, World
from distckpt.state.streams import PrivateStream
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules


class RandomStreamKind(Kind):
    """A random generator held in `state`: its stream's state (streams.py), per rank."""

    stream: ClassVar[PrivateStream]
    scope = PER_RANK
    restore_checked = True  # validate tries the saved state on a scratch copy of the stream

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, self.stream.type)

    def capture(self, entry: Entry) -> Any:
        return self.stream.get(entry.target)

    def stream_state(self, saved: Any) -> Any:
        """The stream's own state inside a saved record's state."""
        return saved

    def check(self, target: Any, saved: Any, where: str) -> None:
        """IncompatibleCheckpointError unless `saved` is a state of a stream like `target`."""

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        self.check(entry.target, saved, where)
        # A saved state that verifies but that the generator refuses (forged) is found before
        # anything changed, not half-way through the restore.
        try:
            self.stream.trial(entry.target, self.stream_state(saved))
        except (TypeError, ValueError, OverflowError, RuntimeError, KeyError) as e:
            raise CorruptCheckpointError(f"{where}: the saved random state would not restore "
                                         f"({type(e).__name__}: {str(e)[:120]})") from e

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        self.stream.set(entry.target, self.stream_state(value))
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        saved = self.stream.get(entry.target)
        return lambda: self.stream.set(entry.target, saved)

    def elastic(self, entry: Entry, saved: list[Any], context: Any) -> Any:
        """Old rank j's stream on new rank j; a new rank past the old world seeds a fresh one
        (elastic_rules.py: never one old rank's stream on two new ranks)."""
        if context.takes_over:
            return saved[context.rank]
        return self.capture(replace(entry, target=seeded_like(entry.target, context.seed(entry.key))))

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset({Trait.RANDOM_STREAM})

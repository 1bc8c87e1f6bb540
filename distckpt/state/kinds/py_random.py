"""A Python `random.Random` in `state`: per rank (a SystemRandom, which has no state, is refused)."""

from __future__ import annotations

import random
from typing import Any

from distckpt.errors import IncompatibleCheckpointError, UnstorableValueError
from distckpt.state.kinds.random_stream import RandomStreamKind
from distckpt.state.streams import PYTHON_RANDOM


class PythonRandom(RandomStreamKind):
    """A random.Random: its Mersenne Twister state."""

    name, stream = "py_random", PYTHON_RANDOM
    description = "a Python random.Random: its state, per rank"

    def matches(self, key: str, obj: Any) -> bool:
        if isinstance(obj, random.SystemRandom):
            raise UnstorableValueError(
                f"state[{key!r}] is a random.SystemRandom: it reads the operating system's entropy and has no "
                "state to save; use random.Random(seed) for a stream that can resume")
        return isinstance(obj, random.Random)

    def check(self, target: Any, saved: Any, where: str) -> None:
        if not (isinstance(saved, tuple) and len(saved) == 3 and isinstance(saved[1], tuple)):
            raise IncompatibleCheckpointError(f"{where}: the checkpoint holds no random.Random state")

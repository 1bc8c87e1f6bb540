"""A NumPy `RandomState` in `state`: per rank."""

from __future__ import annotations

from typing import Any

from distckpt.errors import IncompatibleCheckpointError
from distckpt.state.kinds.random_stream import RandomStreamKind
from distckpt.state.streams import NUMPY_RANDOM_STATE


class NumpyRandomState(RandomStreamKind):
    """A numpy.random.RandomState: its Mersenne Twister state."""

    name, stream = "np_random_state", NUMPY_RANDOM_STATE
    description = "a NumPy RandomState: its Mersenne Twister state, per rank"

    def check(self, target: Any, saved: Any, where: str) -> None:
        if not isinstance(saved, dict) or saved.get("bit_generator") != "MT19937":
            raise IncompatibleCheckpointError(f"{where}: the checkpoint holds no NumPy RandomState state")

"""A NumPy `Generator` in `state` (np.random.default_rng()): per rank."""

from __future__ import annotations

from typing import Any

from distckpt.errors import IncompatibleCheckpointError
from distckpt.state.kinds.random_stream import RandomStreamKind
from distckpt.state.streams import NUMPY_GENERATOR


class NumpyGenerator(RandomStreamKind):
    """A numpy.random.Generator: its bit generator's state."""

    name, stream = "np_generator", NUMPY_GENERATOR
    description = "a NumPy Generator: its bit generator's state, per rank"

    def check(self, target: Any, saved: Any, where: str) -> None:
        here = target.bit_generator.state.get("bit_generator")
        there = saved.get("bit_generator") if isinstance(saved, dict) else None
        if here != there:
            raise IncompatibleCheckpointError(
                f"{where}: a NumPy Generator over {there} was saved, this one runs {here}; create it with "
                f"np.random.Generator(np.random.{there}()) or np.random.default_rng() as the run that saved did")

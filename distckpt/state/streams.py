"""Every random stream distckpt saves, named once, with its capture and restore functions.

A training step draws from more than `torch.get_rng_state()` covers. The streams are:

* a rank's process-wide streams (`PROCESS`): Python's `random`, NumPy's legacy global
  generator and torch's CPU default generator, saved in each rank's file under "rng" and,
  when a loader's epoch starts, in the loader's record of that start (state/epoch_record.py)
  under names of their own there;
* the accelerators' generators (`DEVICES`): every CUDA, MPS and XPU device of the rank, saved
  beside the process streams;
* private streams (`PRIVATE`): a `torch.Generator`, NumPy `Generator` or `RandomState`, or
  `random.Random` object, saved as an entry of `state` (kinds/generator.py and its siblings)
  or found in a loader's sampling (a sampler's generator).

Each is captured as tensors and plain values (what a checkpoint stores) and restored from
them; `trial` restores a saved state into a scratch copy first, so a state that verifies but
that the stream refuses (forged) is found before anything changed. The saved names here are
part of the format: never rename one.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import numpy.random  # noqa: F401  (numpy imports it lazily: ~15 ms inside the first load's timing otherwise)
import torch

# -- plain values for NumPy and Python states ------------------------------------------------------


def numpy_global_state() -> dict[str, Any]:
    """NumPy's legacy global stream (np.random.seed / np.random.rand) as plain values."""
    st = np.random.get_state(legacy=False)
    st["state"] = {"key": st["state"]["key"].tolist(), "pos": int(st["state"]["pos"])}
    st["gauss"] = float(st["gauss"])
    st["has_gauss"] = int(st["has_gauss"])
    return st


def set_numpy_global_state(st: dict[str, Any]) -> None:
    numpy_state_into(np.random, st)


def numpy_state_into(target: Any, st: dict[str, Any]) -> None:
    """`target.set_state` (the np.random module, or a RandomState) with a captured global state."""
    restored = dict(st)
    restored["state"] = {"key": np.asarray(st["state"]["key"], dtype=np.uint32),
                         "pos": st["state"]["pos"]}
    check_mt19937(restored)
    target.set_state(restored)


_MT19937_WORDS = 624


def check_mt19937(state: Any) -> None:
    """ValueError for a Mersenne Twister state NumPy would take and then misuse: it sets the
    position without checking it, and the next draw reads that far into (or before) its 624-word
    array: numbers from outside it, or a segfault, after a load that reported nothing."""
    if not isinstance(state, dict) or state.get("bit_generator") != "MT19937":
        return
    inner = state.get("state")
    pos = inner.get("pos") if isinstance(inner, dict) else None
    pos = int(pos) if isinstance(pos, np.integer) else pos
    if type(pos) is not int or not 0 <= pos <= _MT19937_WORDS:
        raise ValueError(f"its Mersenne Twister position is {pos!r}, not an int from 0 to {_MT19937_WORDS}")
    key = inner.get("key") if isinstance(inner, dict) else None
    if key is None or np.shape(key) != (_MT19937_WORDS,):
        raise ValueError(f"its Mersenne Twister state is not {_MT19937_WORDS} words")


def numpy_to_plain(value: Any) -> Any:
    """A NumPy stream's state as plain values (lists for arrays), as a checkpoint stores it."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: numpy_to_plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def plain_to_numpy(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"ndarray", "dtype"}:
        return np.asarray(value["ndarray"], dtype=value["dtype"])
    if isinstance(value, dict):
        return {k: plain_to_numpy(v) for k, v in value.items()}
    return value


def as_python_state(st: Any) -> tuple[Any, ...]:
    """random.setstate's argument from a saved state (its internal state a tuple, as it insists)."""
    version, internal, gauss = st
    return (version, tuple(internal), gauss)


# -- a rank's process-wide streams -----------------------------------------------------------------

@dataclass(frozen=True)
class ProcessStream:
    """One process-wide stream of a rank."""

    name: str              # its name in a rank's "rng" record
    epoch_start_name: str  # its name in a loader's record of an epoch's start
    capture: Callable[[], Any]
    restore: Callable[[Any], None]
    trial: Callable[[Any], None]         # restore into a scratch copy: raises where the real one would
    well_formed: Callable[[Any], bool]   # the saved state has this stream's structure (may raise on junk)


def _scratch_torch_cpu(state: Any) -> None:
    torch.Generator().set_state(state)


# The scratch stream a saved NumPy global state is tried on. One per thread, made once: a new
# RandomState() seeds itself from the OS (~0.3 ms on 2 busy cores), paid by every rank's every load
# (16 ranks on 2 cores: 8 of them in a row). set_state replaces all of it, so nothing of one trial
# is left for the next.
_numpy_scratch = threading.local()


def _scratch_numpy(state: Any) -> None:
    scratch = getattr(_numpy_scratch, "stream", None)
    if scratch is None:
        scratch = _numpy_scratch.stream = np.random.RandomState(0)
    numpy_state_into(scratch, state)


def _python_well_formed(state: Any) -> bool:
    version, internal, _ = state
    return isinstance(version, int) and len(internal) == 625


def _torch_cpu_well_formed(state: Any) -> bool:
    return (isinstance(state, torch.Tensor) and state.dtype == torch.uint8
            and state.numel() == torch.get_rng_state().numel())


PYTHON = ProcessStream(
    "python", "python", random.getstate, lambda s: random.setstate(as_python_state(s)),
    lambda s: random.Random().setstate(as_python_state(s)), _python_well_formed)
NUMPY = ProcessStream(
    "numpy", "numpy", numpy_global_state, set_numpy_global_state,
    _scratch_numpy,
    lambda s: len(s["state"]["key"]) == 624)
TORCH_CPU = ProcessStream(
    "torch_cpu", "torch", torch.get_rng_state, torch.set_rng_state,
    _scratch_torch_cpu, _torch_cpu_well_formed)

PROCESS = (PYTHON, NUMPY, TORCH_CPU)  # in the order of a rank's "rng" record
EPOCH_START = (TORCH_CPU, PYTHON, NUMPY)  # in the order of a loader's epoch-start record


# -- the accelerators' generators -------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceFamily:
    """The generators of one accelerator family, one per device of the rank."""

    name: str    # its name in a rank's "rng" record
    label: str   # as messages name it
    count: Callable[[], int]                      # devices of this family on this rank
    capture_all: Callable[[], list[torch.Tensor]]  # one state per device
    set: Callable[[int, torch.Tensor], None]       # (device index, state)
    one_state: bool = False         # saved as one state, not a list (MPS: one device at most)
    saved_when_absent: bool = False  # saved (as an empty list) even on a rank without the family

    def saved_states(self, record: dict[str, Any]) -> list[Any]:
        if self.name not in record:
            return []
        return [record[self.name]] if self.one_state else list(record[self.name])

    def in_record(self, states: list[torch.Tensor]) -> Any:
        return states[0] if self.one_state else states


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_states() -> list[torch.Tensor]:
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []


def _set_cuda_state(index: int, state: torch.Tensor) -> None:
    torch.cuda.set_rng_state(state, index)


def _mps_available() -> bool:
    return hasattr(torch, "mps") and hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


# Through lambdas: the module's functions are looked up at each call (tests stand a GPU host in).
CUDA = DeviceFamily("cuda", "CUDA", lambda: _cuda_count(), lambda: _cuda_states(),
                    lambda i, s: _set_cuda_state(i, s), saved_when_absent=True)
MPS = DeviceFamily("mps", "MPS", lambda: 1 if _mps_available() else 0, lambda: [torch.mps.get_rng_state()],
                   lambda i, s: torch.mps.set_rng_state(s), one_state=True)
XPU = DeviceFamily("xpu", "XPU", lambda: torch.xpu.device_count() if _xpu_available() else 0,
                   lambda: [torch.xpu.get_rng_state(i) for i in range(torch.xpu.device_count())],
                   lambda i, s: torch.xpu.set_rng_state(s, i))

DEVICES = (CUDA, MPS, XPU)  # in the order of a rank's "rng" record


# -- private streams: objects a user or a loader holds ------------------------------------------------

@dataclass(frozen=True)
class PrivateStream:
    """A random stream object of one type."""

    type: type
    shown_as: str
    get: Callable[[Any], Any]          # its state as tensors and plain values
    set: Callable[[Any, Any], None]    # (stream, saved state)
    scratch: Callable[[Any], Any]      # a new stream of the same kind, to try a saved state on

    def trial(self, stream: Any, state: Any) -> None:
        """Restore `state` into a scratch copy of `stream`: raises where the real restore would."""
        self.set(self.scratch(stream), state)


def _set_bit_generator(generator: np.random.Generator, state: Any) -> None:
    state = plain_to_numpy(state)
    check_mt19937(state)
    generator.bit_generator.state = state


def _set_random_state(stream: np.random.RandomState, state: Any) -> None:
    state = plain_to_numpy(state)
    check_mt19937(state)
    stream.set_state(state)


TORCH_GENERATOR = PrivateStream(
    torch.Generator, "torch.Generator", lambda g: g.get_state(), lambda g, s: g.set_state(s),
    lambda g: torch.Generator(device=g.device))
NUMPY_GENERATOR = PrivateStream(
    np.random.Generator, "numpy.random.Generator", lambda g: numpy_to_plain(g.bit_generator.state),
    _set_bit_generator, lambda g: np.random.Generator(type(g.bit_generator)()))
NUMPY_RANDOM_STATE = PrivateStream(
    np.random.RandomState, "numpy.random.RandomState", lambda r: numpy_to_plain(r.get_state(legacy=False)),
    _set_random_state, lambda r: np.random.RandomState())
PYTHON_RANDOM = PrivateStream(
    random.Random, "random.Random", lambda r: r.getstate(), lambda r, s: r.setstate(as_python_state(s)),
    lambda r: random.Random())

PRIVATE = (TORCH_GENERATOR, NUMPY_GENERATOR, NUMPY_RANDOM_STATE, PYTHON_RANDOM)


def private_stream_of(obj: Any) -> PrivateStream | None:
    """The private stream `obj` is, None for anything else."""
    return next((stream for stream in PRIVATE if isinstance(obj, stream.type)), None)

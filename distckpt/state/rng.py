"""Process-wide random streams of one rank: capture and restore, for every device family.

`torch.get_rng_state()` covers only torch's CPU default generator. A training step also
reads Python's `random`, NumPy's global generator and each accelerator's generators; all of
them (the table in streams.py) are captured here, and a stream that cannot be put back is a
loud warning, never silence.
"""

from __future__ import annotations

from typing import Any

import torch

from distckpt.errors import (
    CorruptCheckpointError,
    RngRestoreWarning,
    warn,
)
from distckpt.state.streams import DEVICES, PROCESS, DeviceFamily


def capture_process_rng(devices: bool = True) -> dict[str, Any]:
    """Every process-wide stream of this rank, as tensors and plain values.

    `devices=False` leaves the accelerators' streams out: a data-loader worker forked from a
    process that had used CUDA cannot touch CUDA at all ("Cannot re-initialize CUDA in forked
    subprocess"), and a spawned one would pay a CUDA context per worker for it."""
    state: dict[str, Any] = {stream.name: stream.capture() for stream in PROCESS}
    for family in DEVICES:
        if not devices:
            if family.saved_when_absent:
                state[family.name] = []
        elif family.saved_when_absent or family.count() > 0:
            state[family.name] = family.in_record(family.capture_all())
    return state


def check_process_rng(state: Any, where: str) -> None:
    """CorruptCheckpointError unless `state` is what capture_process_rng makes, so that the
    restore, which runs last, cannot fail after everything else was restored."""
    try:
        ok = (all(stream.well_formed(state[stream.name]) for stream in PROCESS)
              and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                      for family in DEVICES for t in family.saved_states(state)))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: the RNG streams are malformed: {type(e).__name__}: {e}") from e
    if not ok:
        raise CorruptCheckpointError(f"{where}: the RNG streams are malformed")
    try:  # each stream put into a scratch generator first: the real restore runs last and must not fail
        for stream in PROCESS:
            stream.trial(state[stream.name])
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise CorruptCheckpointError(f"{where}: an RNG stream would not restore: {type(e).__name__}: {e}") from e


def restore_process_rng(state: dict[str, Any], where: str, devices: bool = True) -> None:
    """Put back what capture_process_rng captured; warn for any stream that cannot be.
    `devices=False`: the CPU streams only (see capture_process_rng)."""
    for stream in PROCESS:
        stream.restore(state[stream.name])
    if not devices:
        return
    for family in DEVICES:
        present = family.count()
        if family.saved_when_absent or family.name in state or present > 0:
            _restore_family(family, family.saved_states(state), present, where)


def _restore_family(family: DeviceFamily, saved: list[Any], present: int, where: str) -> None:
    for index in range(min(len(saved), present)):
        family.set(index, saved[index])
    if len(saved) != present:
        name = family.label
        message = (
            f"{where}: the checkpoint holds {len(saved)} {name} RNG state(s) but this rank has "
            f"{present} {name} device(s); "
            + (f"{name} generators beyond the first {min(len(saved), present)} keep their "
               "current state" if present > len(saved) else
               f"{len(saved) - present} saved {name} stream(s) are dropped")
            + ". Random draws on those devices will not continue the saved run bit for bit.")
        warn(message, RngRestoreWarning)

"""Process-wide random streams of one rank: capture and restore, for every device family.

`torch.get_rng_state()` covers only torch's CPU default generator. A training step also
reads Python's `random`, NumPy's global generator and each accelerator's generators; all of
them are captured here, and a stream that cannot be put back is a loud warning, never silence.
"""

from __future__ import annotations

import logging
import random
import warnings
from typing import Any

import numpy as np
import numpy.random  # noqa: F401  (numpy imports it lazily: ~15 ms inside the first load's timing otherwise)
import torch

from distckpt.errors import (
    CorruptCheckpointError,
    RngRestoreWarning,  # noqa: F401  (re-exported where it was defined)
)

log = logging.getLogger("distckpt")



def capture_process_rng(devices: bool = True) -> dict[str, Any]:
    """Every process-wide stream of this rank, as tensors and plain values.

    `devices=False` leaves the accelerators' streams out: a data-loader worker forked from a
    process that had used CUDA cannot touch CUDA at all ("Cannot re-initialize CUDA in forked
    subprocess"), and a spawned one would pay a CUDA context per worker for it."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": numpy_global_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": _cuda_states() if devices else [],
    }
    if not devices:
        return state
    if _mps_available():
        state["mps"] = torch.mps.get_rng_state()
    if _xpu_available():
        state["xpu"] = [torch.xpu.get_rng_state(i) for i in range(torch.xpu.device_count())]
    return state


def check_process_rng(state: Any, where: str) -> None:
    """CorruptCheckpointError unless `state` is what capture_process_rng makes, so that the
    restore, which runs last, cannot fail after everything else was restored."""
    try:
        version, internal, _ = state["python"]
        numpy_key = state["numpy"]["state"]["key"]
        ok = (isinstance(version, int) and len(internal) == 625 and len(numpy_key) == 624
              and isinstance(state["torch_cpu"], torch.Tensor)
              and state["torch_cpu"].dtype == torch.uint8
              and state["torch_cpu"].numel() == torch.get_rng_state().numel()
              and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in state.get("cuda", [])))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: the RNG streams are malformed: {type(e).__name__}: {e}") from e
    if not ok:
        raise CorruptCheckpointError(f"{where}: the RNG streams are malformed")
    try:  # each stream put into a scratch generator first: the real restore runs last and must not fail
        random.Random().setstate(as_python_state(state["python"]))
        numpy_state_into(np.random.RandomState(), state["numpy"])
        torch.Generator().set_state(state["torch_cpu"])
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise CorruptCheckpointError(f"{where}: an RNG stream would not restore: {type(e).__name__}: {e}") from e


def restore_process_rng(state: dict[str, Any], where: str, devices: bool = True) -> None:
    """Put back what capture_process_rng captured; warn for any stream that cannot be.
    `devices=False`: the CPU streams only (see capture_process_rng)."""
    random.setstate(as_python_state(state["python"]))
    set_numpy_global_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if not devices:
        return
    _restore_device_list("CUDA", state.get("cuda", []), _cuda_count(), _set_cuda_state, where)
    if "mps" in state or _mps_available():
        saved = [state["mps"]] if "mps" in state else []
        _restore_device_list("MPS", saved, 1 if _mps_available() else 0,
                             lambda i, s: torch.mps.set_rng_state(s), where)
    if "xpu" in state or _xpu_available():
        count = torch.xpu.device_count() if _xpu_available() else 0
        _restore_device_list("XPU", state.get("xpu", []), count,
                             lambda i, s: torch.xpu.set_rng_state(s, i), where)


def _restore_device_list(family: str, saved: list[Any], present: int, setter: Any, where: str) -> None:
    for index in range(min(len(saved), present)):
        setter(index, saved[index])
    if len(saved) != present:
        message = (
            f"{where}: the checkpoint holds {len(saved)} {family} RNG state(s) but this rank has "
            f"{present} {family} device(s); "
            + (f"{family} generators beyond the first {min(len(saved), present)} keep their "
               "current state" if present > len(saved) else
               f"{len(saved) - present} saved {family} stream(s) are dropped")
            + ". Random draws on those devices will not continue the saved run bit for bit.")
        log.warning(message)
        warnings.warn(message, RngRestoreWarning, stacklevel=3)


def numpy_global_state() -> dict[str, Any]:
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
    target.set_state(restored)


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
    version, internal, gauss = st
    return (version, tuple(internal), gauss)


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

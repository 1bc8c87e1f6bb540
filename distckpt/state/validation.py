"""Checks of a saved entry against the live object it will be restored into, made on every rank
before anything is changed, so that a load either restores everything or nothing.

Each check names the entry and what to do. What only an owner's own `load_state_dict` can
detect is left to it; the restore then undoes what was applied (undo.py).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from distckpt.errors import ConfigError, CorruptCheckpointError, IncompatibleCheckpointError, shown
from distckpt.state.capture import unwrap_module

# Optimizer state keys that hold one value per parameter element (torch.optim's optimizers):
# their shape must be the parameter's. Others (Adafactor's factored row/column statistics,
# scalars such as `step`) are left to the optimizer.
_PER_ELEMENT_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                               "acc_delta", "sum", "grad_avg", "exp_inf", "ax", "prev", "mu_product_buffer"})


@dataclass(frozen=True)
class LoadRules:
    """How strictly a load matches the checkpoint to the live state (CheckpointManager options)."""

    allow_dtype_cast: bool = False  # a tensor saved as float32 may load into a bfloat16 model
    missing_entries: str = "refuse"  # or "keep": a `state` entry the checkpoint lacks keeps its value


def _module(module: nn.Module, saved: dict[str, Any], where: str, world: tuple[int, int], rules: LoadRules) -> None:
    module = unwrap_module(module)
    current = module.state_dict()
    _check_module_structure(saved, where)
    stored = saved["state_dict"]
    missing = [k for k in current if k not in stored]
    unexpected = [k for k in stored if k not in current]
    wrong = [f"{k}: {tuple(stored[k].shape)} in checkpoint, {tuple(v.shape)} here"
             for k, v in current.items()
             if k in stored and isinstance(v, torch.Tensor) and isinstance(stored[k], torch.Tensor)
             and tuple(v.shape) != tuple(stored[k].shape)]
    names = {name for name, _ in module.named_modules()}
    flags = saved["training"]
    if missing or unexpected or wrong or (flags is not None and set(flags) != names):
        raise IncompatibleCheckpointError(
            f"{where} does not match the checkpoint: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]}, shape mismatches {wrong[:5]}, submodules "
            f"{sorted(set(flags or names) ^ names)[:5]}; build the same model as the run that saved")
    if not rules.allow_dtype_cast:
        _check_dtypes(current, stored, where)
    for key, value in current.items():
        if isinstance(value, torch.Tensor) and key in stored:
            check_writable(value, f"{where}.{key}")


def _check_module_structure(saved: Any, where: str) -> None:
    """What the restore reads of a saved module, beyond the tensors checked below: a file that
    verifies but was forged must fail here, before any parameter is copied."""
    if not isinstance(saved, dict):
        saved = {}
    metadata, flags = saved.get("metadata"), saved.get("training")
    grads = saved.get("requires_grad", {})
    if not (isinstance(saved.get("state_dict"), dict)
            and isinstance(metadata, dict) and all(isinstance(v, dict) for v in metadata.values())
            and (flags is None or (isinstance(flags, dict) and all(isinstance(f, bool) for f in flags.values())))
            and isinstance(grads, dict) and all(isinstance(f, bool) for f in grads.values())):
        raise CorruptCheckpointError(f"{where}: the saved module state does not have the structure distckpt writes "
                                     "(state_dict, metadata, training flags)")


def _check_dtypes(current: Any, stored: Any, where: str) -> None:
    wrong = [f"{k}: {stored[k].dtype} in the checkpoint, {v.dtype} here" for k, v in current.items()
             if isinstance(v, torch.Tensor) and isinstance(stored.get(k), torch.Tensor) and stored[k].dtype != v.dtype]
    if wrong:
        raise IncompatibleCheckpointError(
            f"{where}: tensors would be cast on load ({'; '.join(wrong[:5])}); convert the model to the "
            "checkpoint's dtypes before loading, or pass allow_dtype_cast=True to CheckpointManager")


def _optimizer(opt: Any, saved: Any, where: str, world: tuple[int, int], rules: LoadRules) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        return _stateful(opt, saved, where, world, rules)
    groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
    here = [len(g["params"]) for g in opt.param_groups]
    there = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in groups]
    if here != there:
        raise IncompatibleCheckpointError(
            f"{where}: the optimizer has parameter groups of sizes {here} but the checkpoint has "
            f"{there}; build the optimizer over the same parameters as the run that saved")
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    per_param = saved.get("state", {}) if isinstance(saved, dict) else {}
    for index, param in zip(ids, params):
        for key, value in (per_param.get(index) or {}).items():
            if key in _PER_ELEMENT_KEYS and isinstance(value, torch.Tensor) and value.shape != param.shape:
                raise IncompatibleCheckpointError(
                    f"{where}: the checkpoint's {key!r} of parameter {index} has shape {tuple(value.shape)}, "
                    f"the parameter here {tuple(param.shape)}: the optimizer lists its parameters in "
                    "another order than the run that saved; build it over model.parameters() in the "
                    "same order")
    return None


def _stateful(obj: Any, saved: Any, where: str, world: tuple[int, int], rules: LoadRules) -> None:
    if isinstance(obj, torch.amp.GradScaler) or type(obj).__name__ == "GradScaler":
        _grad_scaler(obj, saved, where)
    elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        _scheduler(obj, saved, where)


def _grad_scaler(scaler: Any, saved: Any, where: str) -> None:
    enabled_here = bool(scaler.is_enabled())
    enabled_there = bool(saved)  # a disabled GradScaler saves {}
    if enabled_here != enabled_there:
        raise IncompatibleCheckpointError(
            f"{where}: the GradScaler is {'enabled' if enabled_here else 'disabled'} here but was "
            f"{'enabled' if enabled_there else 'disabled'} in the run that saved; build it the same way")


def _scheduler(sched: Any, saved: Any, where: str) -> None:
    current = sched.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(current):
        keys = sorted(set(saved) ^ set(current)) if isinstance(saved, dict) else "not a dict"
        raise IncompatibleCheckpointError(
            f"{where}: the scheduler's state does not match the checkpoint's (keys differ: {keys}); build "
            "the same scheduler as the run that saved")
    for key in ("_schedulers",):  # SequentialLR, ChainedScheduler: one state per inner scheduler
        if isinstance(current.get(key), list) and len(current[key]) != len(saved[key] or []):
            raise IncompatibleCheckpointError(
                f"{where}: {len(current[key])} inner schedulers here, {len(saved[key] or [])} in the checkpoint; "
                "build the same scheduler as the run that saved")


def _tensor(target: torch.Tensor, saved: Any, where: str, world: tuple[int, int], rules: LoadRules) -> None:
    if not isinstance(saved, torch.Tensor) or target.shape != saved.shape or (
            target.dtype != saved.dtype and not rules.allow_dtype_cast):
        desc = f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise IncompatibleCheckpointError(
            f"{where}: tensor {desc} in the checkpoint, {tuple(target.shape)} {target.dtype} here")
    check_writable(target, where)


def check_writable(target: torch.Tensor, where: str) -> None:
    """A load copies into `target` in place, after every entry was checked and while nothing is
    snapshotted: refuse here, before anything changes, a tensor that cannot take the copy."""
    if target.device.type == "meta":
        raise IncompatibleCheckpointError(
            f"{where}: a tensor on the meta device holds no values to load into; materialize it first "
            "(module.to_empty(device=...)) and then load")
    if target.is_inference() and not torch.is_inference_mode_enabled():
        raise IncompatibleCheckpointError(
            f"{where}: an inference tensor (made under torch.inference_mode) cannot be written in place "
            "outside it; build the state to load into outside inference_mode")
    if _has_internal_overlap(target):
        raise IncompatibleCheckpointError(
            f"{where}: its elements share memory (an expanded, unfolded or as_strided tensor), so no copy can give each "
            "its saved value; load into a tensor with memory of its own (.clone())")
    if _on_read_only_pages(target):
        raise IncompatibleCheckpointError(
            f"{where}: its memory is mapped read-only (a NumPy array opened with mmap_mode='r', a file mapped "
            "for reading), so the copy would crash the process (SIGSEGV); load into a tensor with memory of its "
            "own (.clone()) or map the file writable (mmap_mode='r+' or 'c')")


def _on_read_only_pages(target: torch.Tensor) -> bool:
    """Whether part of a CPU tensor's bytes lie in a mapping without write permission (Linux,
    /proc/self/maps). Memory torch allocated is writable: only storages torch did not allocate
    (not resizable: from_numpy, frombuffer, a mapped file) are looked up, so a model's thousands
    of parameters cost nothing here."""
    if target.device.type != "cpu" or target.numel() == 0 or target.untyped_storage().resizable():
        return False
    start, end = target.untyped_storage().data_ptr(), target.untyped_storage().data_ptr() + target.untyped_storage().nbytes()
    covered = start
    for low, high, writable in _mappings():
        if high <= covered or low >= end:
            continue
        if low > covered or not writable:
            return low <= covered  # a read-only mapping over the bytes (a gap in between is no mapping we know)
        covered = high
        if covered >= end:
            return False
    return False


class _MappingsSeen:
    during_pass = False
    snapshot: list[tuple[int, int, bool]] | None = None


@contextmanager
def mappings_read_once() -> Iterator[None]:
    """One check pass reads /proc/self/maps once, not per tensor (0.5 ms a read: 0.53 s for a
    model of 1,000 tensors opened by torch's loader with mmap=True); nothing maps memory meanwhile."""
    _MappingsSeen.during_pass, _MappingsSeen.snapshot = True, None
    try:
        yield
    finally:
        _MappingsSeen.during_pass, _MappingsSeen.snapshot = False, None


def _mappings() -> list[tuple[int, int, bool]]:
    """The process's mappings as (start, end, writable), in address order; none off Linux."""
    if _MappingsSeen.snapshot is not None:
        return _MappingsSeen.snapshot
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        span, perms = line.split(" ", 2)[:2]
        low, high = (int(x, 16) for x in span.split("-"))
        found.append((low, high, "w" in perms))
    if _MappingsSeen.during_pass:
        _MappingsSeen.snapshot = found
    return found


def _has_internal_overlap(t: torch.Tensor) -> bool:
    check = getattr(torch, "_debug_has_internal_overlap", None)
    if check is not None:
        answer = int(check(t))  # 0 no, 1 yes, 2 too hard to tell (copy_ does not refuse: unfold loaded wrong values)
        if answer != 2:
            return answer == 1
    elif any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return True
    return not _strides_prove_no_overlap(t) and not _offsets_are_distinct(t)


def _strides_prove_no_overlap(t: torch.Tensor) -> bool:
    """Sufficient: with the dimensions ordered by stride, each stride passes every offset the
    smaller ones reach."""
    reach = 0
    for stride, size in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


_EXACT_OVERLAP_CHECK_MAX = 1 << 22  # elements: the offsets of a larger tensor are not enumerated (taken as overlapping)


def _offsets_are_distinct(t: torch.Tensor) -> bool:
    """Exact, by enumerating every element's offset (only for tensors up to 4M elements)."""
    if t.numel() > _EXACT_OVERLAP_CHECK_MAX:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for dim, (stride, size) in enumerate(zip(t.stride(), t.shape)):
        shape = [1] * t.dim()
        shape[dim] = size
        offsets = offsets + (torch.arange(size, dtype=torch.int64) * stride).reshape(shape)
    return int(offsets.reshape(-1).unique().numel()) == t.numel()


# Steps and epochs go into int64 everywhere else (a logger's tensor, DCP's metadata, another
# reader of the manifest), so a count past int64 is refused rather than stored as a number
# nothing else can hold.
LARGEST_COUNT = 2**63 - 1


def check_step(name: str, value: Any) -> int:
    """An argument that counts (a step, an epoch): an int from 0 to 2**63-1, not a bool (step=False
    was step 0); an IntEnum member or a NumPy integer is taken as its plain int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= LARGEST_COUNT:
        raise ConfigError(f"{name}={shown(value)}: must be an int >= 0 (at most 2**63-1)")
    return int(value)

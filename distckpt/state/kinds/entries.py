"""What the save and load phases call: `state` classified into entries, each captured,
validated, snapshotted and restored by its kind. Nothing here knows a kind by its name.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distckpt.errors import (
    CorruptCheckpointError,
    DistCkptError,
    IncompatibleCheckpointError,
    StateArgumentError,
    UnstorableValueError,
)
from distckpt.io.staging import region_key
from distckpt.state import sharded
from distckpt.state.capture import (
    CONFIG_KEY,
    PER_RANK,
    SHARDED,
    Entry,
    PerRank,
    Release,
    _owned,
    note_user_error,
    persistent_buffers,
    unwrap_module,
)
from distckpt.state.kinds.base import Kind, World
from distckpt.state.kinds.builtin import BUILTIN
from distckpt.state.kinds.registry import UnknownKind, kind_named, matching_kind, registered_kinds
from distckpt.state.kinds.sharded_optimizer import ShardedOptimizer
from distckpt.state.kinds.tensor import Tensor
from distckpt.state.kinds.value import Value
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules

_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)


def classify(state: dict[str, Any]) -> list[Entry]:
    """Classify every top-level entry of `state` (a dict with str keys)."""
    if not isinstance(state, dict):
        raise StateArgumentError(f"state={repr(state)[:60]}: must be a dict of entries (str keys: a model, an "
                                 f"optimizer, a loader ...), got {type(state).__name__}")
    sharded.reshard_fully_sharded(obj.obj if isinstance(obj, PerRank) else obj for obj in state.values())
    entries = []
    for key, obj in state.items():
        if type(key) is not str:  # a subclass (np.str_, a str enum) would come back as a plain str
            raise StateArgumentError(f"state=: its key {key!r} is a {type(key).__name__}; the entries of `state` "
                                     "are named by plain str keys ('model', 'optimizer', ...): use str(key)")
        forced = isinstance(obj, PerRank)
        target = obj.obj if forced else obj
        kind = _kind_of(key, target)
        kind.observe(target)
        entries.append(Entry(key, PER_RANK if forced else kind.scope, kind.name, target,
                             reshard=obj.reshard if forced else None))
    return _link_optimizers(entries)


def _kind_of(key: str, target: Any) -> Kind:
    # What the registry gives a plain tensor or Parameter under any key but "config", without
    # asking each kind in turn (20 us of each of a 2,000-tensor state's entries): the tensor kind,
    # unless a kind registered beside the built-in ones is asked before it.
    if type(target) in _PLAIN_TENSOR_TYPES and key != CONFIG_KEY:
        shortcut = _plain_tensor_kind(registered_kinds())
        if shortcut is not None:
            return shortcut
    return matching_kind(key, target)


_shortcut: tuple[tuple[Kind, ...], Kind | None] = ((), None)


def _plain_tensor_kind(order: tuple[Kind, ...]) -> Kind | None:
    global _shortcut
    if _shortcut[0] is not order:
        found = None
        for kind in order:  # the built-in kinds asked before it never take a plain tensor (but config, by key)
            if type(kind) is Tensor:
                found = kind
            if type(kind) is Tensor or type(kind) not in BUILTIN:
                break
        _shortcut = (order, found)
    return _shortcut[1]


def _link_optimizers(entries: list[Entry]) -> list[Entry]:
    """Give each optimizer the module that holds its parameters; over DTensor parameters it is
    sharded, and its state can only be named (and resharded) through that module."""
    modules = [(e, {id(p) for p in unwrap_module(e.target).parameters()}) for e in entries if e.kind_spec.holds_weights]
    out = []
    for e in entries:
        if e.scope != PER_RANK and isinstance(e.target, torch.optim.Optimizer):
            params = sharded.optimizer_params(e.target)
            owner = next((unwrap_module(m.target) for m, ids in modules
                          if all(id(p) in ids for p in params)), None)
            if sharded.has_dtensor_params(params):
                if owner is None:
                    raise UnstorableValueError(
                        f"state[{e.key!r}] is an optimizer over sharded (DTensor) parameters, but no "
                        "module in `state` holds all of them; put the FSDP2 / DTensor model in `state` too")
                e = Entry(e.key, SHARDED, ShardedOptimizer.name, e.target, owner)
            else:
                e = Entry(e.key, e.scope, e.kind, e.target, owner)
        out.append(e)
    return out


# -- save ----------------------------------------------------------------------------------------

def capture_entry(entry: Entry) -> dict[str, Any]:
    """The entry's state as a tree of tensors and plain values (tagged with its kind; an
    optimizer also with its class, which its state_dict does not say)."""
    try:
        state = entry.kind_spec.capture(entry)
    except DistCkptError:
        raise
    except Exception as e:  # the user's own state_dict(): keep its type (callers catch it), say where
        note_user_error(e, entry.key, entry.kind)
        raise
    out = {"kind": entry.kind, "state": state}
    if isinstance(entry.target, torch.optim.Optimizer):
        out["type"] = type(entry.target).__name__
    return out


def capture_rank_buffers(entries: list[Entry]) -> dict[str, dict[str, torch.Tensor]]:
    """Each model entry's persistent buffers as this rank holds them (BatchNorm statistics).

    Buffers are not synchronised by FSDP2, nor by DDP with ``broadcast_buffers=False``: each rank
    updates its own from its own batches, so restoring rank 0's everywhere changed every other
    rank's forward after a resume (measured: FSDP2 with a BatchNorm in eval mode, rank 1 differed
    from the first step on). They travel in each rank's own file, as small as they usually are.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for e in entries:
        if e.kind_spec.holds_weights and e.scope != PER_RANK:
            buffers = persistent_buffers(unwrap_module(e.target))
            if buffers:
                out[e.key] = buffers
    return out


def copy_destinations(entries: list[Entry]) -> list[torch.Tensor]:
    """The live tensors a load copies into in place: tensor entries, and the parameters and
    buffers of module entries (copying.Prefault faults their pages in while the files are read)."""
    return [t for entry in entries for t in entry.kind_spec.copy_destinations(entry)]


def staged_tensors(entries: list[Entry]) -> list[torch.Tensor]:
    """The tensors an async save of these entries copies into staging buffers, as far as they
    can be told without encoding: what a load copies into (copy_destinations), sharded modules'
    pieces and optimizers' state (a DTensor's local piece, as sharded saves stage it); a tied
    weight once, as it is staged once."""
    unique: dict[Any, torch.Tensor] = {}
    for t in (t for entry in entries for t in entry.kind_spec.staged_tensors(entry)):
        if isinstance(t, torch.Tensor):
            local = (t.to_local() if hasattr(t, "to_local") else t).detach()
            unique.setdefault(region_key(local) or id(local), local)
    return list(unique.values())


# -- load ----------------------------------------------------------------------------------------

def loading_entry(entry: Entry, saved_kind: Any) -> Entry:
    """The entry as it is restored from a checkpoint whose entry has `saved_kind`: sharded state
    also loads into a plain module and its optimizer (a world of one gathers it whole)."""
    return kind_named(saved_kind).loads_into(entry) or entry


def resolve_sharded_entry(entry: Entry, saved_state: Any, reader: "sharded.ShardReader") -> Any:
    """Sharded references in `saved_state` replaced by this rank's pieces (checks shapes and keys)."""
    return entry.kind_spec.resolve_shards(entry, saved_state, reader)


def resolves_own_shards(saved_kind: Any) -> bool:
    """Whether records of `saved_kind` hold references to sharded pieces their kind resolves
    (resolve_sharded_entry); any other record's split tensors are resolved whole."""
    return kind_named(saved_kind).scope == SHARDED


def normalize_imported(entry: Entry, saved: dict[str, Any]) -> dict[str, Any]:
    """A saved record as the live entry's kind restores it: an imported entry shaped as that
    kind stores it (a module's state_dict gets the module record around it, with no training
    flags); others are returned unchanged."""
    if not isinstance(saved, dict):
        return saved
    return kind_named(saved.get("kind")).as_loaded_into(entry, saved)


def replaced_under_key(entries: list[Entry], saved: dict[str, Any]) -> list[Entry]:
    """The entries as restored when a plain value was saved where a tensor is now, or a tensor
    where a plain value is now (a best loss kept as a float until the first evaluation makes it a
    0-d tensor): replaced under its key, as a plain value is, and its saved record with it."""
    out = []
    for entry in entries:
        record = saved.get(entry.key)
        if (isinstance(record, dict) and entry.kind_spec.replaceable_by_value and record.get("kind") != entry.kind
                and kind_named(record.get("kind")).replaceable_by_value):
            record["kind"] = Value.name
            entry = Entry(entry.key, entry.scope, Value.name, entry.target, entry.owner, entry.reshard)
        out.append(entry)
    return out


def validate_entry(entry: Entry, saved: dict[str, Any], world: World, rules: LoadRules = LoadRules()) -> None:
    """Raise IncompatibleCheckpointError if `saved` cannot be restored into `entry` whole."""
    where = f"state[{entry.key!r}]"
    if saved.get("kind") != entry.kind:
        raise IncompatibleCheckpointError(
            f"{where} is a {entry.kind} entry here but a {saved.get('kind')} entry in the checkpoint"
            f"{_unregistered_hint(saved.get('kind'))}")
    saved_type, live_type = saved.get("type"), type(entry.target).__name__
    if isinstance(entry.target, torch.optim.Optimizer) and isinstance(saved_type, str) and saved_type != live_type:
        raise IncompatibleCheckpointError(
            f"{where} is a {live_type} here but a {saved_type} in the checkpoint: its state (moments, "
            f"hyperparameters) means something else to another optimizer; build a {saved_type} as the run "
            "that saved did, or leave the optimizer out of `state` to start it afresh")
    try:
        entry.kind_spec.validate(entry, saved["state"], where, world, rules)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:  # a forged file that verifies
        raise CorruptCheckpointError(f"{where}: the saved state does not have the structure of a {entry.kind} "
                                     f"entry ({type(e).__name__}: {str(e)[:120]})") from e


def _unregistered_hint(saved_kind: Any) -> str:
    """The fix when the saved kind is one this process never registered: the likely cause of a
    mismatch when the job that saved registered a kind of its own."""
    if not isinstance(kind_named(saved_kind), UnknownKind):
        return ""
    return (f": kind {saved_kind!r} is not registered in this process. Import the module that calls "
            f"register_kind for it (as the job that saved did) before loading, then load again; nothing was changed")


def snapshot(entry: Entry, state: dict[str, Any]) -> Undo:
    """A function that puts `entry` back as it is now."""
    return entry.kind_spec.undo(entry, state)


def restore_entry(entry: Entry, saved: dict[str, Any], state: dict[str, Any],
                  memo: dict[Any, Any] | None = None, release: Release | None = None) -> list[str]:
    """Restore one validated entry in place; returns notes for the caller (config diffs).
    Entries restored with one `memo` keep the tensors they share shared. `release` is called
    with each source tensor once it is copied (the protocol's PageRelease)."""
    kind, value = entry.kind_spec, saved["state"]
    if kind.copies_loaded_tensors:
        value = _owned(value, memo, release)
    return kind.restore(entry, value, state, release)


def is_late(entry: Entry) -> bool:
    """Restored in the second phase, after every rank restored the early entries."""
    return entry.kind_spec.is_late(entry)

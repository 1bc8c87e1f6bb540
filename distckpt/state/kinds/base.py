"""Entry kinds: what `state` may hold, one class each, declaring everything callers ask of it.

Every top-level entry of `state` is of one kind, found by asking the registered kinds in turn
(registry.py: the first whose `matches` says yes). The kind captures the entry into a tree of
tensors and plain values, checks a saved tree against the live object before anything
changes (`validate`), restores it in place, and puts it back after a failed load (`undo`). The
save and load phases, the command line and the doctor never test a kind's name: they ask the
kind (`entry.kind_spec.holds_weights`, `kind.shown_as(record)`, ...). Its `name` is written into
every checkpoint (`{"kind": name, "state": ...}`) and read back with `kind_named(name)`.

Adding a kind
-------------
One module, one class, one call::

    from distckpt.errors import IncompatibleCheckpointError
    from distckpt.state.kinds import PER_RANK, Kind, register_kind

    class Reservoir(Kind):
        '''A reservoir sampler of the user's: its items and its count.'''

        name = "reservoir"                  # saved in every checkpoint: never rename it
        description = "a reservoir sampler: its items and count"
        scope = PER_RANK                   # each rank its own (default: REPLICATED, rank 0's)

        def matches(self, key, obj):       # which objects are of this kind
            return isinstance(obj, ReservoirSampler)

        def capture(self, entry):          # tensors and plain values only (DESIGN.md §1)
            return {"items": list(entry.target.items), "seen": entry.target.seen}

        def validate(self, entry, saved, where, world, rules):  # refuse before anything changes
            if not isinstance(saved, dict) or "items" not in saved:
                raise IncompatibleCheckpointError(f"{where}: no reservoir in the checkpoint")

        def restore(self, entry, value, state, release):  # in place; returns notes (none)
            entry.target.items, entry.target.seen = list(value["items"]), value["seen"]
            return []

        def undo(self, entry, state):      # put the entry back as it is now (a failed load)
            items, seen = list(entry.target.items), entry.target.seen
            return lambda: entry.target.__dict__.update(items=items, seen=seen)

    register_kind(Reservoir)

`register_kind` places a kind before the generic ones (`generic = True`: anything with
state_dict, any tensor, any value), after every specific kind registered before it; pass
`before=` another kind class to be tried earlier. Register it in every process that saves or
loads such entries (importing the module that defines it); a process that does not know it
(`distckpt inspect` elsewhere) shows its records by name. Everything else has a default that
fits a kind holding small per-entry state: override only what differs. The class attributes of
`Kind` say what callers branch on; its methods after `restore` are what the doctor, `distckpt
inspect` and `load_weights` ask of a saved record (they may run in a process where the live
object was never built). The rules a kind keeps: `capture` returns tensors and plain values
only, `validate` refuses (IncompatibleCheckpointError, naming `where` and the fix) everything
`restore` could fail on, and `undo` puts back whatever `restore` changes.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping

import torch

from distckpt.errors import ElasticResumeError
from distckpt.state.capture import PER_RANK, REPLICATED, SHARDED, Entry, Release  # noqa: F401  (a kind's scopes)
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules

World = tuple[int, int]  # (rank, world size)


class Trait(str, enum.Enum):
    """What a saved entry is, as the doctor reasons about a job: which entries it holds, which
    it lacks. A kind says which of these its records have (`Kind.traits`)."""

    WEIGHTS = "weights"                # a model's parameters and buffers
    OPTIMIZER = "optimizer"            # an optimizer's moments, step counts and learning rates
    LR_SCHEDULE = "lr_schedule"        # a learning-rate schedule's position
    DATA_POSITION = "data_position"    # where a data loader is in its pass
    SAMPLING_ORDER = "sampling_order"  # a sampler's epoch and seed
    RANDOM_STREAM = "random_stream"    # a random generator
    PLAIN_VALUE = "plain_value"        # a loop variable (a counter, a best loss)
    CONFIG = "config"                  # the run's settings


@dataclass(frozen=True)
class Differing:
    """One leaf of a saved entry that differs between two runs (the doctor's comparison)."""

    where: str   # "replicated", "rank R", "shards of rank R"
    key: str     # the entry's key in `state`
    path: str    # inside the entry's record: "state/...", "kind"
    detail: str  # "3 of 9 elements differ, ...", "15 uninterrupted, 5 resumed"


@dataclass(frozen=True)
class Job:
    """What the doctor knows of the job at the step compared: every saved entry's traits (by
    key; empty when not known) and kinds, those of the entries that differ, the first step that
    differs, and the entries whose records show draws no checkpoint holds
    (draws_outside_checkpoint)."""

    traits: Mapping[str, frozenset[Trait]] = field(default_factory=dict)
    differing: Mapping[str, frozenset[Trait]] = field(default_factory=dict)
    first_step: int | None = None
    kinds: Mapping[str, "Kind"] = field(default_factory=dict)
    draws_outside: frozenset[str] = frozenset()

    def keys_of(self, kind: "Kind") -> list[str]:
        """The saved entries of `kind`, by key."""
        return sorted(key for key, k in self.kinds.items() if k is kind)

    def holds(self, trait: Trait) -> bool:
        """Whether some saved entry has `trait` (False when the entries are not known)."""
        return any(trait in traits for traits in self.traits.values())

    @property
    def known(self) -> bool:
        return bool(self.traits)

    def differs_in(self, trait: Trait) -> bool:
        return any(trait in traits for traits in self.differing.values())


class Kind:
    """One kind of entry. Subclasses set `name` and override what differs."""

    name: ClassVar[str]               # written into every checkpoint: never rename
    description: ClassVar[str] = ""   # one line: what it holds (docs/guides/custom-kinds.md)
    scope: ClassVar[str] = REPLICATED  # where its state is written unless per_rank() says otherwise
    generic: ClassVar[bool] = False    # claims objects by a duck type: tried after every specific kind
    late: ClassVar[bool] = False       # restored after every rank restored the rest: checked completely first
    # An early entry whose restore cannot fail once `validate` passed (a random stream tried on a
    # scratch copy, a plain value put in place): a load whose early entries are all such restores
    # every entry before its one exchange of outcomes, without the exchange between the early and
    # the late entries (loading._apply_phase); any other early entry keeps that exchange.
    restore_checked: ClassVar[bool] = False
    # Restored values are copied out of the file's buffer first: an owner that keeps the tensors it
    # is given (an optimizer keeps its state tensors) would otherwise keep the whole buffer alive.
    copies_loaded_tensors: ClassVar[bool] = True
    # Its restore reads the loaded buffers only through the release's copies (a tensor entry):
    # nothing else of the file is touched, so the pages are not let go of wholesale after it.
    restores_by_copies_alone: ClassVar[bool] = False
    # A replicated entry each rank holds a copy of, digested at every save: ranks must agree, or
    # the save is refused (rank 0's copy would silently become every rank's on resume). On for
    # every kind: one that turns it off says why in `not_compared_because` (register_kind refuses
    # a replicated kind that is not compared and says nothing).
    compared_across_ranks: ClassVar[bool] = True
    not_compared_because: ClassVar[str] = ""  # how its ranks' agreement is checked instead
    # Its tensors are handed over as loaded (refilled into a value, given to load_state_dict):
    # saved with their device, they go back to it, as torch.load does.
    handed_over: ClassVar[bool] = False
    # A model: its parameters are sampled into the ranks' agreement, its buffers saved per rank,
    # its parameters fingerprinted by the doctor, exported by `distckpt export`.
    holds_weights: ClassVar[bool] = False
    holds_data_position: ClassVar[bool] = False  # a data loader: a loop's loader left out of `state` is told
    # A saved record of one of these kinds is restored as a plain value into an entry of another
    # (a best loss saved as a float, a 0-d tensor now): replaced under its key.
    replaceable_by_value: ClassVar[bool] = False

    # -- which objects -----------------------------------------------------------------------

    def matches(self, key: str, obj: Any) -> bool:
        """Whether `obj` (under `state[key]`) is of this kind; raise UnstorableValueError for an
        object that looks like one and cannot be stored, naming `state[key]` and the fix."""
        return False

    def observe(self, target: Any) -> None:
        """Called each time a save or load classifies `state`: start watching what a later
        capture needs (a loader's epoch starts)."""

    # -- save ---------------------------------------------------------------------------------

    def prepare_capture(self, entry: Entry) -> None:
        """Called on every rank before the process's random streams are recorded for a save:
        anything the capture itself would draw is drawn here (a loader's first iterator)."""

    def capture(self, entry: Entry) -> Any:
        """The entry's state as tensors and plain values (None, bool, int, float, str, list,
        tuple, dict): what a checkpoint stores, encoded after this returns."""
        raise NotImplementedError(f"{type(self).__name__}.capture")

    def compared_value(self, entry: Entry) -> Any:
        """What the ranks' agreement digests (compared_across_ranks): by default what `capture`
        returns, so `capture` of a replicated entry runs on every rank at each save."""
        return self.capture(entry)

    def staged_tensors(self, entry: Entry) -> list[Any]:
        """The tensors an async save of the entry copies into staging buffers, as far as they can
        be told without encoding (warmed ahead of the first save)."""
        return list(self.copy_destinations(entry))

    # -- load ---------------------------------------------------------------------------------

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        """Raise IncompatibleCheckpointError if `saved` cannot be restored into the entry whole."""

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        """Restore in place; returns notes for the caller (config differences)."""
        raise NotImplementedError(f"{type(self).__name__}.restore")

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        """A function that puts the entry back as it is now."""
        return lambda: None

    def is_late(self, entry: Entry) -> bool:
        return self.late

    def after_load(self, entry: Entry) -> None:
        """Called on every rank once a load is over (a fresh start too)."""

    def in_place_copies(self, entry: Entry, record: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(where, stored tensor, live tensor) for every copy a restore of `record` makes into a
        live tensor in place: checked for overlapping destinations, and their ties kept."""
        return iter(())

    def copy_destinations(self, entry: Entry) -> list[torch.Tensor]:
        """The live tensors a load copies into in place (their pages faulted in ahead)."""
        return []

    def from_imported(self, entry: Entry, state: Any) -> dict[str, Any]:
        """The record an imported entry (torch.save / DCP) makes for this kind."""
        return {"kind": self.name, "state": state}

    def loads_into(self, entry: Entry) -> Entry | None:
        """The entry as it is restored from a record of this kind when it is of another kind here
        (sharded state into a plain module), None when it cannot be."""
        return None

    def as_loaded_into(self, entry: Entry, record: dict[str, Any]) -> dict[str, Any]:
        """A saved record of this kind as `entry`'s kind restores it (an imported record takes the
        shape of the live entry's kind); most records are restored as they are."""
        return record

    def elastic(self, entry: Entry, saved: list[Any], context: Any) -> Any:
        """This rank's state of a per-rank entry at another world size (world_size_policy=
        "elastic"), made from `saved`: every old rank's saved state, in old rank order; `context`
        is an elastic.ElasticContext (the new rank and world, the step, a seed source). Restored
        as a saved state is (validate, then restore). The default refuses: a per-rank value has
        no rule to map it to another number of ranks unless its kind has one."""
        raise ElasticResumeError(
            f"state[{entry.key!r}] ({self.name} entry) is per rank, and its {context.old_world_size} saved values have "
            f"no rule to become {context.world_size}: wrap it as distckpt.per_rank(obj, reshard=fn) with "
            "fn(old_values, new_world_size) -> one value per new rank, or load with world_size_policy='reshard' "
            "(each rank keeps the value it has) (docs: guides/elastic.md)")

    def resolve_shards(self, entry: Entry, saved_state: Any, reader: Any) -> Any:
        """`saved_state` with its references to sharded pieces replaced by this rank's (scope
        SHARDED: read from whichever ranks' shard files overlap them; checks shapes and keys)."""
        return saved_state

    # -- what a saved record is (the doctor, inspect, load_weights) -----------------------------

    def shown_as(self, record: dict[str, Any]) -> str:
        """A short label: inspect's and the doctor's name for what the record holds."""
        return self.name

    def summary(self, state: Any) -> dict[str, Any]:
        """A few plain values that tell a saved state apart (inspect's per-rank summary)."""
        return {}

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset()

    def saved_weights(self, state: Any) -> dict[str, Any] | None:
        """The model state_dict a saved state of this kind holds (load_weights, export), None
        when it holds none."""
        return None

    def draws_outside_checkpoint(self, record: dict[str, Any]) -> bool:
        """Whether the record shows random draws that no checkpoint holds (loader workers over a
        dataset not wrapped with with_worker_rng)."""
        return False

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        """What usually makes these leaves of entries of this kind differ between an
        uninterrupted run and a killed-and-resumed one, and the fix (the doctor's report)."""
        return []


def shown(value: Any) -> Any:
    """`value` as plain values a summary shows: a tensor as its description, never its bytes."""
    if isinstance(value, torch.Tensor):
        parameter = isinstance(value, torch.nn.Parameter)
        grad = " requires_grad" if value.requires_grad and not parameter else ""
        return f"<{'parameter' if parameter else 'tensor'} {str(value.dtype).replace('torch.', '')} {list(value.shape)}{grad}>"
    if isinstance(value, dict):
        return {str(k): shown(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [shown(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value

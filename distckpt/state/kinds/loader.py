"""A data loader with state_dict (torchdata's StatefulDataLoader): its position, per rank.

Beside torchdata's own keys, its saved state holds the loader's own generator, what its
position counts in (the samplers' kinds, the dataset's length, the order's settings), the
record of its epoch's start for a sampler replayed from it (replay.py), the samplers' epochs,
and whether the loop had dropped its iterator.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from distckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError, UnstorableValueError, warn
from distckpt.state import elastic, elastic_rules, epoch_record, loader_hazards, loader_plan, replay, undo
from distckpt.state.capture import (
    FABRIC_MODULES,
    PER_RANK,
    CheckpointWarning,
    Entry,
    Release,
    _has_state_dict,
    has_class_named,
)
from distckpt.state.elastic import ELASTIC_KEY
from distckpt.state.kinds.base import Differing, Job, Kind, Trait, World, shown
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules
from distckpt.state.workers import WorkerRngDataset, WorkerRngIterableDataset


class Loader(Kind):
    """A data loader with state_dict (torchdata's StatefulDataLoader): its position."""

    name, scope = "loader", PER_RANK
    description = "a data loader with state_dict (torchdata's StatefulDataLoader): its position, per rank"
    holds_data_position = True

    def matches(self, key: str, obj: Any) -> bool:
        if isinstance(obj, torch.utils.data.DataLoader) and not issubclass(type(obj), torch.utils.data.DataLoader):
            # Hugging Face Accelerate's prepared loader (DataLoaderShard, DataLoaderDispatcher)
            # answers __class__ with its base loader's class: taken for one, every resume drew
            # another shuffle order and moved the global stream (it fetches a batch ahead and
            # reseeds each epoch, none of which its base loader's position holds)
            raise UnstorableValueError(
                f"state[{key!r}] is {type(obj).__module__}.{type(obj).__name__}, a wrapper that passes for a "
                f"{obj.__class__.__name__} (Hugging Face Accelerate's prepared loader): it iterates its loader a "
                "batch ahead and reseeds it each epoch, so a resume would not continue exactly. Keep the loader out "
                "of accelerator.prepare(): build a torchdata StatefulDataLoader with a DistributedSampler and put "
                "that in `state` (docs: guides/frameworks.md, Accelerate)")
        if has_class_named(obj, "_FabricDataLoader", *FABRIC_MODULES):
            # Its __iter__ calls set_epoch on the sampler with its own count of iter() calls, which
            # restarts at 0 in a resumed process: a resume took another epoch's order, silently
            raise UnstorableValueError(
                f"state[{key!r}] is Lightning Fabric's loader wrapper (fabric.setup_dataloaders): each iter() sets the "
                "sampler's epoch to its own count of iter() calls, which restarts at 0 in a resumed process, so a "
                "resume would take another epoch's order. Iterate the torchdata StatefulDataLoader itself (with "
                "a DistributedSampler you build, sampler.set_epoch(epoch) at each epoch start) and put that in "
                "`state`; move batches with fabric.to_device (docs: guides/frameworks.md, Lightning Fabric)")
        if isinstance(obj, torch.utils.data.DataLoader) and not _has_state_dict(obj):
            raise UnstorableValueError(
                f"state[{key!r}] is a DataLoader without state_dict(): its position cannot be "
                "saved; use torchdata.stateful_dataloader.StatefulDataLoader (a drop-in "
                "replacement, `pip install torchdata`) and keep it in `state`: with only its sampler "
                "and generator, a mid-epoch save resumes from the epoch's first batch")
        return isinstance(obj, torch.utils.data.DataLoader)

    def capture(self, entry: Entry) -> Any:
        was_dropped = loader_plan.dropped(entry.target)  # first: nothing here may hold its iterator yet
        if getattr(entry.target, "in_order", True) is False and getattr(entry.target, "num_workers", 0) > 0:
            # torchdata keeps no position it can resume then: batches come as workers finish them
            # (a resume lost one batch and repeated another, silently)
            raise UnstorableValueError(
                f"state[{entry.key!r}] is a loader with in_order=False and workers: its batches arrive in the order "
                "the workers finish them, and torchdata cannot resume such a position. Build it with in_order=True "
                "(the default) to checkpoint it, or leave it out of `state`")
        _warn_unwrapped_workers(entry)
        loader_hazards.warn_lossy_dataset_state(entry.target, entry.key)
        loader_hazards.refuse_a_fabric_wrapper(entry.target, entry.key)
        untouched = loader_plan.restored_untouched(entry.target)
        if untouched is not None:  # restored and not iterated since: saved as it was loaded (state_dict()
            # would start the next pass here, after a dropped iterator, and save that pass's start: the
            # same future in other bytes, which made `distckpt doctor` report a resume that was exact)
            saved, was_dropped = dict(untouched.state), untouched.dropped
        else:
            saved = entry.target.state_dict()
        generator = _own_generator(entry.target)
        if generator is not None and isinstance(saved, dict):
            # The loader's generator= shuffles and seeds every later epoch; the loader's state
            # does not hold it, so a generator not also put in `state` came back untouched and the
            # next epoch's order differed from the uninterrupted run's. It travels with the loader.
            saved = {**saved, _LOADER_GENERATOR: generator.get_state()}
        if isinstance(saved, dict):
            saved = {**saved, _LOADER_MAKEUP: _loader_makeup(entry.target), ELASTIC_KEY: elastic_rules.describe(entry.target)}
        sampling = replay.capture(entry.target, entry.key) if untouched is None else untouched.replay
        if sampling is not None and isinstance(saved, dict):
            saved = {**saved, replay.REPLAY_KEY: sampling}
        if was_dropped and isinstance(saved, dict):
            saved = {**saved, loader_plan.DROPPED_KEY: True}
        epochs = epoch_record.capture_epochs(entry.target, was_dropped,
                                       mid_pass=None if untouched is None else untouched.mid_pass)
        if epochs is not None and isinstance(saved, dict):
            saved = {**saved, epoch_record.EPOCHS_KEY: epochs}
        return saved

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        if not isinstance(saved, dict):
            return
        if _ELASTIC_RESUME in saved:  # made by elastic() for this loader: its generator, checked below
            saved = {k: v for k, v in saved.items() if k == _LOADER_GENERATOR}
        workers = _saved_worker_count(saved)
        live = getattr(entry.target, "num_workers", 0)
        if workers is not None and workers != live:
            raise IncompatibleCheckpointError(
                f"{where}: the loader was saved with num_workers={workers} and this one has num_workers={live}: "
                "torchdata resumes a position only with the same number of workers (a different number "
                f"failed at the next iter()); build the loader with num_workers={workers}")
        _check_loader_makeup(entry.target, saved.get(_LOADER_MAKEUP), where)
        _check_positions(entry.target, saved, where)
        replay.check(entry.target, saved.get(replay.REPLAY_KEY), where)
        if _LOADER_GENERATOR in saved:
            generator = _own_generator(entry.target)
            if generator is None:
                raise IncompatibleCheckpointError(
                    f"{where}: the loader was saved with a generator= of its own and this one has none, so its "
                    "later epochs would shuffle differently: build it with generator=torch.Generator()")
            try:
                torch.Generator(device=generator.device).set_state(saved[_LOADER_GENERATOR])
            except (TypeError, RuntimeError) as e:
                raise IncompatibleCheckpointError(f"{where}: the loader's generator state does not fit its "
                                                  f"generator: {e}") from e

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        if isinstance(value, dict) and _ELASTIC_RESUME in value:
            return _restore_elastic(entry, value)
        sampling, was_dropped, epochs = None, False, None
        if isinstance(value, dict) and isinstance(value.get(ELASTIC_KEY), dict):
            value = dict(value)
            _reinstall_remainder(entry.target, value.pop(ELASTIC_KEY), value)
        if isinstance(value, dict) and ({_LOADER_GENERATOR, _LOADER_MAKEUP, replay.REPLAY_KEY, loader_plan.DROPPED_KEY,
                                         epoch_record.EPOCHS_KEY} & set(value)):
            value = dict(value)
            value.pop(_LOADER_MAKEUP, None)
            epochs = value.pop(epoch_record.EPOCHS_KEY, None)
            sampling = value.pop(replay.REPLAY_KEY, None)
            was_dropped = value.pop(loader_plan.DROPPED_KEY, False) is True
            generator_state = value.pop(_LOADER_GENERATOR, None)
            generator = _own_generator(entry.target)
            if generator is not None and generator_state is not None:  # validated
                generator.set_state(generator_state)
        _warn_iterator_made_before(entry)
        entry.target.load_state_dict(value)
        loader_plan.plan_resume(entry.target, sampling, was_dropped, epochs, f"state[{entry.key!r}]", restored=value)
        return []

    def elastic(self, entry: Entry, saved: list[Any], context: Any, held: list[int] | None = None) -> Any:
        """The rest of the interrupted epoch for this rank (elastic_rules.plan_for; `held`: batches
        each old rank's wrapper held ahead of its loop, not consumed), and the loader's own
        generator by the streams' rule: old rank j's on new rank j, else seeded."""
        plan = elastic_rules.plan_for(entry.key, saved, entry.target, context, held)
        out: dict[str, Any] = {_ELASTIC_RESUME: {"plan": None if plan is None else plan.as_record()}}
        generator = _own_generator(entry.target)
        if generator is not None:
            if context.takes_over and isinstance(saved[context.rank], dict) and _LOADER_GENERATOR in saved[context.rank]:
                out[_LOADER_GENERATOR] = saved[context.rank][_LOADER_GENERATOR]
            else:
                seeded = elastic_rules.seeded_like(generator, context.seed(f"{entry.key}/generator"))
                out[_LOADER_GENERATOR] = seeded.get_state()
        return out

    def observe(self, target: Any) -> None:
        loader_plan.watch(target)  # each epoch's start, for a save in its middle

    def prepare_capture(self, entry: Entry) -> None:
        loader_plan.make_first_iterator(entry.target)  # it draws: before the streams are recorded

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        attributes = dict(vars(entry.target))  # StatefulDataLoader.load_state_dict only sets attributes
        generator = _own_generator(entry.target)
        before = generator.get_state() if generator is not None else None
        holder = getattr(entry.target, "batch_sampler", None)
        inner = getattr(holder, "sampler", None)  # an elastic resume puts its remainder sampler there

        def put_back() -> None:
            if holder is not None and getattr(holder, "sampler", None) is not inner:
                holder.sampler = inner
            undo.replace_dict(vars(entry.target), attributes.items())
            if generator is not None and before is not None:
                generator.set_state(before)

        return put_back

    # -- what a saved record is ------------------------------------------------------------------

    def summary(self, state: Any) -> dict[str, Any]:
        return {"position": _position(state)} if isinstance(state, dict) else {}

    def traits(self, record: dict[str, Any]) -> frozenset[Trait]:
        return frozenset({Trait.DATA_POSITION})

    def draws_outside_checkpoint(self, record: dict[str, Any]) -> bool:
        """Read by workers (torchdata's `_num_workers` > 0) and holding no worker streams (its
        dataset is not wrapped with with_worker_rng): their draws are in no checkpoint."""
        workers = wrapped = False
        for path, value in _leaves(record.get("state"), ""):
            if path.endswith("/_num_workers") and type(value) is int and value > 0:
                workers = True
            if "/worker_rng" in path:
                wrapped = True
        return workers and not wrapped

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        causes = []
        streams = [d for d in differing if _WORKER_STREAMS in d.path]
        if streams:  # saved only for a dataset wrapped with with_worker_rng: it is wrapped
            ranks = sorted({d.where for d in streams if d.where.startswith("rank")})
            causes.append(f"{', '.join(ranks) or 'a rank'}: `{streams[0].key}` worker streams differ from step "
                          f"{job.first_step} → the workers started their pass at another point after the resume: an "
                          "iterator made twice (a peek `next(iter(loader))` at an epoch's start takes the resumed "
                          "position), or a batch drawn before the save; or the dataset draws from a generator of its "
                          "own in the workers")
        for key in (k for k in job.keys_of(self) if k in job.draws_outside):
            causes.append(f"`{key}` worker streams differ (not saved) → `{key}` is read by loader workers and its "
                          "dataset is not wrapped with distckpt.with_worker_rng, so their random draws (augmentation) "
                          "restart differently after a resume; wrap the dataset")
        ahead = _batches_ahead(differing)
        if ahead:
            causes.append(f"the loader in `state` is {ahead} ahead in the resumed run → at the save it was {ahead} "
                          "ahead of what the loop consumed: a prefetcher holds them (prefetching: a "
                          "wrapper taking batches ahead of the loop, as timm's PrefetchLoader, or a batch drawn before "
                          "the save), and "
                          "the resume skipped them. Keep the held batches in `state` (docs: guides/loop-patterns.md; "
                          "distckpt.integrations.timm for timm's prefetcher)")
        elif any(_WORKER_STREAMS not in d.path and d.path != "kind" for d in differing):
            causes.append("the loader's position differs → a batch drawn before the save (prefetching) is not in "
                          "state (keep it there: docs: guides/loop-patterns.md), or an iterator made twice after the "
                          "resume (a peek `next(iter(loader))` at an epoch's start) took the resumed position")
        return causes


_WORKER_STREAMS = "worker_rng"  # with_worker_rng's key for the workers' streams (workers.py)
_YIELDED = re.compile(r"(-?\d+) uninterrupted, (-?\d+) resumed")


def _batches_ahead(differing: list[Differing]) -> str:
    """How far the resumed run's loader is ahead of the uninterrupted run's at the first step
    compared ("" when it is not, or it cannot be told): "N batch(es)", or "at least 1 batch" when
    the resumed pass had ended and the uninterrupted one had not. A prefetcher's batches skipped
    by the resume put it ahead; an iterator made twice (a peek) puts it behind."""
    ahead, ended_first = 0, False
    for d in differing:
        found = _YIELDED.fullmatch(d.detail) if d.path.endswith("/_num_yielded") else None
        if found:
            ahead = max(ahead, int(found.group(2)) - int(found.group(1)))
        ended_first |= d.path.endswith("/_iterator_finished") and d.detail == "False uninterrupted, True resumed"
    return f"{ahead} batch(es)" if ahead > 0 else "at least 1 batch" if ended_first else ""


def _leaves(value: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{path}/{i}")]
    return [(path, value)]


# A StatefulDataLoader's position fields, without workers and in a worker snapshot's main part
_POSITION_FIELDS = ("_num_yielded", "_sampler_iter_yielded", "_iterator_finished", "_num_workers", "_snapshot_step",
                    "_steps_since_snapshot", "_last_yielded_worker_id")


def _position(state: dict[str, Any]) -> dict[str, Any]:
    """A StatefulDataLoader's position: its own fields without workers; with workers, those of its
    main-process snapshot plus the snapshot's step and the batches yielded since."""
    out = {k: shown(v) for k, v in state.items() if k in _POSITION_FIELDS}
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict):
        out.update({k: shown(v) for k, v in snapshot.items() if k in _POSITION_FIELDS})
        main = snapshot.get("_main_snapshot")
        if isinstance(main, dict):
            out.update({k: shown(v) for k, v in main.items() if k in _POSITION_FIELDS})
    return out


_LOADER_GENERATOR = "_distckpt_loader_generator"  # beside torchdata's keys in the loader's saved state
_LOADER_MAKEUP = "_distckpt_loader_makeup"  # what its position counts in: the samplers' kinds, the dataset's length


def _loader_makeup(loader: Any) -> dict[str, Any]:
    """What a saved position means only together with: a position taken over a shuffled sampler
    put into a loader built with shuffle=False failed at the next iter() with a bare
    AssertionError from torchdata; over a dataset of another length the rest of the epoch came
    from another permutation (items seen before the save came again), silently."""
    makeup: dict[str, Any] = {name: type(getattr(loader, name)).__qualname__
                              for name in ("sampler", "batch_sampler") if getattr(loader, name, None) is not None}
    try:
        makeup["dataset_len"] = len(loader.dataset)
    except (TypeError, NotImplementedError, AttributeError):  # an IterableDataset: no length to compare
        pass
    # A batch sampler of the user's (batch_sampler=): the position counts its batches, so another
    # batch size resumed at another item (5 batches of 2 saved, 5 batches of 3 skipped), silently
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if getattr(loader, "batch_size", 0) is None and isinstance(size, int) and not isinstance(size, bool):
        makeup["batch_sampler_batch_size"] = size
    settings = epoch_record.sampler_settings(loader)
    if settings:
        makeup["sampler_settings"] = settings
    return makeup


def _check_loader_makeup(loader: Any, saved: Any, where: str) -> None:
    if not isinstance(saved, dict):
        return  # saved before the makeup was recorded
    live = _loader_makeup(loader)
    for name in ("sampler", "batch_sampler"):
        if name in saved and name in live and saved[name] != live[name]:
            raise IncompatibleCheckpointError(
                f"{where}: the loader was saved with {name} {saved[name]} and this one has {live[name]} (shuffle= or "
                f"{name}= changed?): its position counts in that {name}'s order; build the loader as it was saved")
    size = "batch_sampler_batch_size"
    if size in saved and size in live and saved[size] != live[size]:
        raise IncompatibleCheckpointError(
            f"{where}: the loader's batch sampler was saved with batch_size={saved[size]} and this one has "
            f"batch_size={live[size]}: a batch sampler's position counts its batches, so the resume would continue "
            f"at another item (some never seen in this epoch, or seen twice); build it with batch_size={saved[size]}, "
            "or change it at an epoch boundary with the loader left out of that load")
    _check_sampler_settings(saved.get("sampler_settings"), live.get("sampler_settings", {}), where)
    if "dataset_len" in saved and "dataset_len" in live and saved["dataset_len"] != live["dataset_len"]:
        raise IncompatibleCheckpointError(
            f"{where}: the loader's dataset has {live['dataset_len']} items and had {saved['dataset_len']} when saved: "
            "the saved position would continue another epoch's order (items seen before the save again, others never); "
            "resume over the same dataset, or start the new data at an epoch boundary without the loader's state")


def _check_sampler_settings(saved: Any, live: dict[str, dict[str, bool]], where: str) -> None:
    if not isinstance(saved, dict):
        return  # saved before the settings were recorded
    for path, settings in sorted(saved.items()):
        if not isinstance(settings, dict) or path not in live:
            continue
        for name, was in sorted(settings.items()):
            is_ = live[path].get(name)
            if is_ is not None and is_ != was:
                raise IncompatibleCheckpointError(
                    f"{where}: the loader's {path} was saved with {name}={was} and has {name}={is_} here: its position "
                    f"counts in the saved order, so the resume would continue another one (items seen before the save "
                    f"again, others never); build the sampler with {name}={was}, or change it at an epoch boundary with "
                    "the loader left out of that load")


_ELASTIC_RESUME = "_distckpt_elastic_resume"  # a record elastic() made: the rest of the epoch, no torchdata state


def _restore_elastic(entry: Entry, value: dict[str, Any]) -> list[str]:
    """A fresh pass of the loader over this rank's share of the interrupted epoch's rest (no
    torchdata position: its next iterator starts the share's pass, its workers seeded from the
    rank's streams as any new pass is)."""
    generator = _own_generator(entry.target)
    if generator is not None and _LOADER_GENERATOR in value:  # validated
        generator.set_state(value[_LOADER_GENERATOR])
    _warn_iterator_made_before(entry)
    loader_plan.forget_plan(entry.target)
    plan = value[_ELASTIC_RESUME].get("plan")
    if plan is not None:
        elastic.install(entry.target, elastic.ElasticPlan.from_record(plan), entry.target.batch_sampler.sampler.rank)
    return []


def _reinstall_remainder(loader: Any, described: dict[str, Any], value: dict[str, Any]) -> None:
    """A loader saved while it ran a resized epoch's rest, loaded at the world that ran it: the
    rest is installed again before torchdata skips the batches taken (unless the pass was over)."""
    plan = described.get("plan")
    if plan is None or value.get("_iterator_finished") is True or elastic_rules.unsupported(loader):
        return
    plan = elastic.ElasticPlan.from_record(plan)
    sampler = loader.batch_sampler.sampler
    sampler = sampler.original if isinstance(sampler, elastic.RemainderSampler) else sampler
    if plan.current_world != sampler.num_replicas:
        raise IncompatibleCheckpointError(
            f"the loader was saved running the rest of an epoch resized to {plan.current_world} ranks and its sampler "
            f"has num_replicas={sampler.num_replicas} here: load with world_size_policy='elastic' at another world size, "
            "or build the sampler with num_replicas=world size")
    elastic.install(loader, plan, sampler.rank)


def _warn_iterator_made_before(entry: Entry) -> None:
    """An iterator of the loader made before the load (`it = iter(loader)` above load_latest)
    goes on from where it was, not from the checkpoint's position: only the next iter() resumes.
    Said rather than refused: a loop that rolls back with load(state, step) and then iterates
    afresh is right."""
    loader = entry.target
    if getattr(loader, "_iterator", None) is None or getattr(loader, "_initial_iter_for_state_dict", False):
        return
    message = (f"state[{entry.key!r}]: an iterator of this loader was made before this load; it goes on from its "
               "own position, not the checkpoint's. Make the iterator after the load (iter(loader) or "
               "`for batch in loader` after load_latest); only a new one resumes")
    warn(message, CheckpointWarning)


def _own_generator(loader: Any) -> torch.Generator | None:
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator) and generator is not torch.default_generator:
        return generator
    return None  # torch's default generator travels with the process's streams


# torchdata's counts of where a loader is (batches given, indices drawn, samples a sampler gave):
# handed to torchdata as they are, a forged one failed at the loop's next batch with a raw TypeError or
# StopIteration, or (negative) replayed the whole epoch, silently
_POSITION_COUNTS = frozenset({"_num_yielded", "_sampler_iter_yielded", "samples_yielded", "_steps_since_snapshot"})


def _check_positions(loader: Any, saved: dict[str, Any], where: str) -> None:
    """CorruptCheckpointError for a position count that no pass of this loader reaches: not an
    int, negative, or beyond the longest of its dataset, sampler and batches; or a pass-ended flag
    that is not a bool."""
    bound = max((n for n in (_length(getattr(loader, name, None)) for name in ("dataset", "sampler"))
                 if n is not None), default=None)
    loader_length = _length(loader)
    if bound is not None and loader_length is not None:
        bound = max(bound, loader_length)
    pending: list[tuple[Any, int]] = [(saved, 0)]
    while pending:
        node, depth = pending.pop()
        if not isinstance(node, dict) or depth > 6:
            continue
        for key, value in node.items():
            if key in _POSITION_COUNTS and not (type(value) is int and value >= 0 and (bound is None or value <= bound)):
                raise CorruptCheckpointError(f"{where}: the loader's saved position {key}={value!r} is not a count "
                                             f"from 0 to {bound if bound is not None else 'its length'}: damaged")
            if key == "_iterator_finished" and type(value) is not bool:
                raise CorruptCheckpointError(f"{where}: the loader's saved _iterator_finished={value!r} is not a bool: "
                                             "damaged")
            pending.append((value, depth + 1))


def _length(obj: Any) -> int | None:
    try:
        n = len(obj)
    except Exception:  # noqa: BLE001  (no length, or one that cannot be computed: no bound from it)
        return None
    return n if type(n) is int and n >= 0 else None


def _saved_worker_count(saved: dict[str, Any]) -> int | None:
    """The num_workers a StatefulDataLoader state was saved with (None: not torchdata's layout)."""
    snapshot = saved.get("_snapshot")
    if isinstance(snapshot, dict):
        main = snapshot.get("_main_snapshot")
        count = main.get("_num_workers") if isinstance(main, dict) else None
        return count if isinstance(count, int) else None
    return 0 if "_num_yielded" in saved else None


_WARNED_LOADERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _warn_unwrapped_workers(entry: Entry) -> None:
    """Once per loader with workers: they seed their own random streams when an epoch starts, and only a
    dataset wrapped with with_worker_rng carries them in the loader's state. A dataset that draws
    nothing needs no wrapper, which is why this warns rather than refuses."""
    loader = entry.target
    dataset = getattr(loader, "dataset", None)
    if loader in _WARNED_LOADERS or isinstance(dataset, (WorkerRngDataset, WorkerRngIterableDataset)):
        return
    if getattr(loader, "num_workers", 0) <= 0:
        return  # replayed in this process from the streams its epoch started with (replay.py)
    _WARNED_LOADERS.add(loader)
    message = (f"state[{entry.key!r}] loads with {loader.num_workers} workers and its dataset is not wrapped "
               "with distckpt.with_worker_rng(dataset): random draws inside the workers (augmentation, "
               "random crops) will not resume exactly. Wrap the dataset, or ignore this if it draws nothing")
    warn(message, CheckpointWarning)

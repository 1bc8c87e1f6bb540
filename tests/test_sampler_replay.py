"""Samplers that keep no state of their own (torch's RandomSampler, WeightedRandomSampler,
SubsetRandomSampler, custom ones drawing from any stream), in a StatefulDataLoader resumed
anywhere: torchdata replays such a sampler from scratch, which is exact only from the streams its
epoch started with; the resumed run once drew another order, silently."""

from __future__ import annotations

import os
import random
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, Dataset, RandomSampler, Sampler, SubsetRandomSampler, WeightedRandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt

ITEMS = 12
STEPS = 20  # a little over three epochs of 6 batches


class Items(Dataset):
    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> int:
        return i


class NumpyShuffle(Sampler[int]):
    """A custom sampler drawing from NumPy's global stream."""

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        yield from np.random.permutation(ITEMS).tolist()


class OwnRandom(Sampler[int]):
    """A custom sampler with a Python random.Random of its own."""

    def __init__(self) -> None:
        self.rng = random.Random(3)

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        order = list(range(ITEMS))
        self.rng.shuffle(order)
        yield from order


class OwnNumpyGenerator(Sampler[int]):
    """Draws lazily, one item at a time, from a NumPy Generator of its own."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(4)

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        for _ in range(ITEMS):
            yield int(self.rng.integers(ITEMS))


class EagerLengthGrouped(Sampler[int]):
    """HF's LengthGroupedSampler shape: the order drawn inside __iter__, returned as iter(list)."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(11)

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        order = torch.randperm(ITEMS, generator=self.generator).tolist()
        megabatches = [sorted(order[i:i + 4]) for i in range(0, ITEMS, 4)]
        return iter([i for m in megabatches for i in m])


class EagerGlobal(Sampler[int]):
    """Draws eagerly from torch's global stream."""

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        return iter(torch.randperm(ITEMS).tolist())


class DuckBucketBatches:
    """A bucketing batch sampler that does not subclass Sampler (only __iter__ and __len__), with a
    torch.Generator of its own: it went unseen, and a resume in the second epoch replayed the
    first epoch's order, silently."""

    def __init__(self) -> None:
        self.g = torch.Generator().manual_seed(7)

    def __len__(self) -> int:
        return ITEMS // 2

    def __iter__(self):
        order = torch.randperm(ITEMS, generator=self.g).tolist()
        batches = [order[i:i + 2] for i in range(0, ITEMS, 2)]
        return iter([batches[j] for j in torch.randperm(len(batches), generator=self.g).tolist()])


class DuckOwnRandom:
    """A sampler that does not subclass Sampler, with a random.Random of its own, drawing lazily."""

    def __init__(self) -> None:
        self.rng = random.Random(5)

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        for _ in range(ITEMS):
            yield self.rng.randrange(ITEMS)


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(7)


SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "random-own-generator": lambda: {"sampler": RandomSampler(Items(), generator=_g())},
    "random-global-stream": lambda: {"sampler": RandomSampler(Items())},
    "random-replacement": lambda: {"sampler": RandomSampler(Items(), replacement=True, num_samples=ITEMS,
                                                            generator=_g())},
    "weighted": lambda: {"sampler": WeightedRandomSampler(torch.linspace(0.1, 1.0, ITEMS), ITEMS, generator=_g())},
    "subset-random": lambda: {"sampler": SubsetRandomSampler(list(range(ITEMS)), generator=_g())},
    "batch-sampler": lambda: {"batch_sampler": BatchSampler(RandomSampler(Items(), generator=_g()), 2, False)},
    "numpy-global": lambda: {"sampler": NumpyShuffle()},
    "own-python-random": lambda: {"sampler": OwnRandom()},
    "own-numpy-generator": lambda: {"sampler": OwnNumpyGenerator()},
    "eager-length-grouped": lambda: {"sampler": EagerLengthGrouped()},
    "eager-global": lambda: {"sampler": EagerGlobal()},
    "eager-batch-sampler": lambda: {"batch_sampler": BatchSampler(EagerLengthGrouped(), 2, False)},
    "duck-bucket-batch-sampler": lambda: {"batch_sampler": DuckBucketBatches()},
    "duck-own-random": lambda: {"sampler": DuckOwnRandom()},
}


def _loader(name: str, workers: int, sampler_in_state: bool) -> tuple[StatefulDataLoader, dict]:
    sampling = SAMPLERS[name]()
    batching = {} if "batch_sampler" in sampling else {"batch_size": 2}
    loader = StatefulDataLoader(Items(), num_workers=workers, **sampling, **batching)
    state: dict[str, Any] = {"loader": loader}
    if sampler_in_state and "sampler" in sampling:
        state["sampler"] = sampling["sampler"]
    return loader, state


def _run(loader: StatefulDataLoader, steps: range, save_at: int | None = None,
         mgr: distckpt.CheckpointManager | None = None, state: dict | None = None) -> list[tuple]:
    """Each step's batch and one draw of each global stream (what a step's dropout or
    augmentation sees)."""
    out = []
    it = iter(loader)
    for step in steps:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        out.append((step, batch.tolist(), torch.rand(1).item(), random.random(), float(np.random.rand())))
        if step == save_at and mgr is not None and state is not None:
            mgr.save(step, state)
    return out


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _resumes_exactly(root: str, build: Callable[[], tuple[StatefulDataLoader, dict]], save_at: int,
                     steps: int = STEPS, **options: Any) -> None:
    """Run `steps` steps saving at `save_at`, then resume in a loader built anew from other
    streams: every step after the save is the uninterrupted run's."""
    _seed_all(0)
    loader, state = build()
    with distckpt.CheckpointManager(root, **options) as mgr:
        assert mgr.load_latest(state) is None  # the documented start: the manager sees the loader first
        reference = _run(loader, range(steps), save_at, mgr, state)
    _seed_all(99)  # the resumed process starts from other streams
    loader, state = build()
    with distckpt.CheckpointManager(root, **options) as mgr:
        progress = mgr.load_latest(state)
    assert progress is not None and progress.step == save_at
    assert _run(loader, range(save_at + 1, steps)) == reference[save_at + 1:]


def _check(root: str, name: str, workers: int, save_at: int, sampler_in_state: bool) -> None:
    _resumes_exactly(root, lambda: _loader(name, workers, sampler_in_state), save_at)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save_at", [3, 8])  # mid-epoch in the first and in the second epoch
def test_a_loader_over_a_sampler_without_state_resumes_exactly(tmp_path, name, workers, save_at):
    _check(str(tmp_path / "c"), name, workers, save_at, sampler_in_state=False)


@pytest.mark.parametrize("name", ["random-own-generator", "weighted", "random-replacement", "own-python-random"])
@pytest.mark.parametrize("save_at", [5, 8, 11])  # the last batch of an epoch, mid-epoch, an epoch's end
def test_a_sampler_also_in_state_resumes_exactly(tmp_path, name, save_at):
    # The sampler's generator restored to its save-time state (the Sampler entry) is where the
    # replay once started from.
    _check(str(tmp_path / "c"), name, 0, save_at, sampler_in_state=True)


class SeededStream(torch.utils.data.IterableDataset):
    """Each pass seeds a generator of its own from torch's global stream, and draws per item from
    it and from a Python random.Random the dataset holds."""

    def __init__(self) -> None:
        self.rng = random.Random(5)

    def __iter__(self):
        g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,)).item()))
        for i in torch.randperm(ITEMS, generator=g).tolist():
            yield i * 1000 + self.rng.randrange(1000)


@pytest.mark.parametrize("save_at", [3, 8, 11])
def test_an_iterable_dataset_seeding_each_pass_resumes_exactly(tmp_path, save_at):
    root = str(tmp_path / "c")

    def build():
        loader = StatefulDataLoader(SeededStream(), batch_size=2)
        return loader, {"loader": loader}

    _resumes_exactly(root, build, save_at)


@pytest.mark.parametrize("name", ["random-own-generator", "random-global-stream", "weighted", "own-python-random",
                                  "duck-bucket-batch-sampler"])
def test_a_random_sampler_whose_epoch_started_unseen_is_refused_at_save(tmp_path, name):
    # The first save in the middle of an epoch the manager did not see start (no load_latest
    # before the loop): its replay cannot be exact, so the save is refused and nothing committed.
    loader, state = _loader(name, 0, sampler_in_state=False)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        it = iter(loader)
        next(it)
        with pytest.raises(distckpt.UnstorableValueError, match=r"load_latest\(state\) before iterating"):
            mgr.save(0, state)
        assert mgr.committed_steps() == []
        assert mgr.load_latest(state) is None  # seen now: the next epoch is replayable
        for _ in it:
            pass
        next(iter(loader))
        mgr.save(1, state)
        assert mgr.committed_steps() == [1]


def test_a_deterministic_custom_sampler_whose_epoch_started_unseen_is_said_once(tmp_path):
    class Reversed(Sampler[int]):
        def __len__(self) -> int:
            return ITEMS

        def __iter__(self):
            yield from range(ITEMS - 1, -1, -1)

    loader = StatefulDataLoader(Items(), sampler=Reversed(), batch_size=2)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        it = iter(loader)
        next(it)
        with pytest.warns(distckpt.ReplayWarning, match="Reversed keeps no state"):
            mgr.save(0, {"loader": loader})
        next(it)
        mgr.save(1, {"loader": loader})  # said once per loader
        assert sorted(mgr.committed_steps()) == [0, 1]


def test_a_loader_resumed_with_another_sampler_is_refused_with_nothing_changed(tmp_path):
    loader, state = _loader("random-own-generator", 0, sampler_in_state=False)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest(state)
        _run(loader, range(3), 2, mgr, state)
    loader, state = _loader("numpy-global", 0, sampler_in_state=False)
    before = {k: v for k, v in vars(loader).items() if k != "_get_iterator"}
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match="saved with sampler RandomSampler and this one has NumpyShuffle"):
            mgr.load_latest(state)
    assert {k: v for k, v in vars(loader).items() if k != "_get_iterator"} == before  # nothing restored
    assert [b.tolist() for b in loader][:1] != []  # and it iterates from its start


@pytest.mark.parametrize("save_at", [8, 14])  # the second and third epochs start by _reset, not a new iterator
def test_persistent_workers_resume_a_sampler_without_state_exactly(tmp_path, save_at):
    root = str(tmp_path / "c")

    def build():
        loader = StatefulDataLoader(Items(), sampler=RandomSampler(Items(), generator=_g()), batch_size=2,
                                    num_workers=2, persistent_workers=True)
        return loader, {"loader": loader}

    _resumes_exactly(root, build, save_at)


@pytest.mark.parametrize("persistent", [False, True])
def test_an_abandoned_iterator_is_freed_at_once_with_its_workers(tmp_path, persistent):
    # The epoch recorder once held the iterator in a cycle: an abandoned iterator (and its worker
    # processes) lived until the cyclic collector ran, and every later test waited 10-20 s.
    import gc
    import weakref

    loader = StatefulDataLoader(Items(), sampler=RandomSampler(Items(), generator=_g()), batch_size=2,
                                num_workers=2, persistent_workers=persistent)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest({"loader": loader})
        it = iter(loader)
        next(it)
        mgr.save(0, {"loader": loader})
    gc.disable()
    try:
        ref = weakref.ref(it)
        del it
        loader._iterator = None  # the loader's own reference (persistent workers keep one)
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save_at", [3, 6])  # 7 items in batches of 2: step 3 is the partial last batch
@pytest.mark.parametrize("name", ["random-own-generator", "random-global-stream", "eager-length-grouped"])
def test_a_save_on_a_partial_last_batch_resumes_the_next_epoch_exactly(tmp_path, workers, save_at, name):
    # The partial batch had asked the sampler once more (RandomSampler then draws for the rest of
    # its permutation); the replay stopped short of that draw and the next epoch differed.
    global ITEMS
    root = str(tmp_path / "c")
    items, ITEMS = ITEMS, 7
    try:
        _check(root, name, workers, save_at, sampler_in_state=False)
    finally:
        ITEMS = items


@pytest.mark.parametrize("name", ["random-global-stream", "eager-global", "eager-length-grouped"])
@pytest.mark.parametrize("save_at", [8, 14])  # epochs started by _reset: no base seed drawn before the sampler
def test_persistent_workers_resume_samplers_on_any_stream_exactly(tmp_path, name, save_at):
    root = str(tmp_path / "c")

    def build():
        loader = StatefulDataLoader(Items(), batch_size=2, num_workers=2, persistent_workers=True,
                                    **SAMPLERS[name]())
        return loader, {"loader": loader}

    _resumes_exactly(root, build, save_at)


class WorkerShuffled(torch.utils.data.IterableDataset):
    """Each worker shuffles its share with its own global torch stream when a pass starts, and
    draws per item from it too."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        order = torch.randperm(ITEMS).tolist()
        mine = order if info is None else order[info.id::info.num_workers]
        for i in mine:
            yield float(i) + torch.rand(1).item()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save_at", [4, 8])
def test_a_wrapped_iterable_dataset_shuffling_each_pass_resumes_exactly(tmp_path, workers, save_at):
    # with_worker_rng replayed the pass from the streams of the save, not of the pass's start:
    # the shuffle drawn at the start came out different (11 of 16 steps differed).
    root = str(tmp_path / "c")

    def build():
        loader = StatefulDataLoader(distckpt.with_worker_rng(WorkerShuffled()), batch_size=2, num_workers=workers)
        return loader, {"loader": loader}

    _resumes_exactly(root, build, save_at)


def test_an_iterator_made_before_the_load_is_warned_about(tmp_path):
    # It went on from its own start after a resume, silently (the checkpoint's position only
    # reaches the next iter()).
    loader, state = _loader("random-own-generator", 0, sampler_in_state=False)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(state)
        _run(loader, range(3), 2, mgr, state)
    loader, state = _loader("random-own-generator", 0, sampler_in_state=False)
    early = iter(loader)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.warns(distckpt.CheckpointWarning, match="iterator of this loader was made before this load"):
            mgr.load_latest(state)
    assert next(early) is not None
    loader, state = _loader("random-own-generator", 0, sampler_in_state=False)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr, warnings.catch_warnings():
        warnings.simplefilter("error", distckpt.CheckpointWarning)
        mgr.load_latest(state)  # nothing made before: nothing said


VAL_SAMPLING = {
    "in-order": lambda: {},
    "shuffle": lambda: {"shuffle": True},
    "random-global-stream": lambda: {"sampler": RandomSampler(Items())},
    "eager-length-grouped": lambda: {"sampler": EagerLengthGrouped()},
}


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("sampling", sorted(VAL_SAMPLING))
@pytest.mark.parametrize("save_at", [2, 4])  # right after an evaluation, and one step later
def test_a_loader_whose_iterator_the_loop_drops_resumes_with_a_new_pass(tmp_path, workers, persistent, sampling,
                                                                         save_at):
    # `next(iter(val))` every few steps: the uninterrupted run's next iter() starts a new pass.
    # The resumed run's first iter() continued the dropped iterator's pass, silently.
    root = str(tmp_path / "c")

    def build():
        train = StatefulDataLoader(Items(), batch_size=2, shuffle=True)
        val = StatefulDataLoader(Items(), batch_size=2, num_workers=workers, persistent_workers=persistent,
                                 **VAL_SAMPLING[sampling]())
        return train, val, {"train": train, "val": val}

    def run(train, val, steps, mgr=None, state=None):
        out, it = [], iter(train)
        for step in steps:
            batch = next(it, None)
            if batch is None:
                it = iter(train)
                batch = next(it)
            row = [step, batch.tolist()]
            if step % 3 == 2:
                row.append(next(iter(val)).tolist())
            row.append(torch.rand(1).item())
            out.append(row)
            if step == save_at and mgr is not None:
                mgr.save(step, state)
        return out

    _seed_all(0)
    train, val, state = build()
    with distckpt.CheckpointManager(root) as mgr:
        assert mgr.load_latest(state) is None
        reference = run(train, val, range(12), mgr, state)
    _seed_all(99)
    train, val, state = build()
    with distckpt.CheckpointManager(root) as mgr:
        assert mgr.load_latest(state).step == save_at
    assert run(train, val, range(save_at + 1, 12)) == reference[save_at + 1:]


class UnevenShards(torch.utils.data.IterableDataset):
    """22 items split between the workers: with batches of 4 one worker runs out a batch before
    the other."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = range(22) if info is None else range(22)[info.id::info.num_workers]
        for i in mine:
            yield i + torch.rand(1).item()


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("save_at", [4, 5, 10])  # one worker's share handed over; the epoch's last batch
def test_a_worker_whose_share_had_ended_yields_nothing_more_in_that_pass(tmp_path, persistent, save_at):
    # The wrapped dataset said "position 0" for an ended share: the resumed worker started it
    # again inside the same epoch (three extra batches, every later step shifted).
    root = str(tmp_path / "c")

    def build():
        loader = StatefulDataLoader(distckpt.with_worker_rng(UnevenShards()), batch_size=4, num_workers=2,
                                    persistent_workers=persistent)
        return loader, {"loader": loader}

    _resumes_exactly(root, build, save_at, steps=16)


def test_a_loader_with_in_order_false_and_workers_is_refused_at_save(tmp_path):
    # torchdata keeps no resumable position then: a resume lost a batch and repeated another.
    loader = StatefulDataLoader(Items(), batch_size=2, num_workers=2, in_order=False)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest({"loader": loader})
        it = iter(loader)
        next(it)
        with pytest.raises(distckpt.UnstorableValueError, match="in_order=False"):
            mgr.save(0, {"loader": loader})
        assert mgr.committed_steps() == []


def test_the_torchdata_internals_the_replay_reads_are_there():
    # replay.py reads these to replay a sampler exactly; a torchdata release renaming one would
    # make resumes inexact: this fails first, naming it.
    from torchdata.stateful_dataloader import sampler as td_sampler

    loader = StatefulDataLoader(Items(), sampler=RandomSampler(Items()), batch_size=2)
    it = iter(loader)
    for name in ("_sampler_iter", "_index_sampler", "_sampler_iter_yielded", "_reset", "_finished"):
        assert hasattr(it, name), name
    assert hasattr(loader, "_iterator") and hasattr(loader, "_initial_iter_for_state_dict")
    assert type(it._sampler_iter).__name__ == "_BatchSamplerIterator"
    for name in ("sampler", "sampler_iter", "samples_yielded", "batch_size"):
        assert hasattr(it._sampler_iter, name), name
    assert type(loader.batch_sampler) is td_sampler.BatchSampler


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", ["random-own-generator", "eager-length-grouped", "random-global-stream"])
def test_async_saves_replay_a_sampler_without_state_exactly(tmp_path, name, workers, overlap):
    _resumes_exactly(str(tmp_path / "c"), lambda: _loader(name, workers, sampler_in_state=False), 8,
                     async_save=True, overlap_snapshot=overlap)


@settings(max_examples=int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "6")), deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(SAMPLERS)), workers=st.sampled_from([0, 2]), persistent=st.booleans(),
       items=st.integers(5, 13), save_at=st.integers(0, STEPS - 2))
def test_any_sampler_saved_anywhere_resumes_exactly(tmp_path_factory, name, workers, persistent, items, save_at):
    # The next counterexample, not the last one: any sampler of the matrix, any dataset length
    # (partial last batches), any save position, with and without persistent workers.
    global ITEMS
    saved_items, ITEMS = ITEMS, items
    try:
        def build() -> tuple[StatefulDataLoader, dict]:
            sampling = SAMPLERS[name]()
            batching = {} if "batch_sampler" in sampling else {"batch_size": 2}
            loader = StatefulDataLoader(Items(), num_workers=workers, persistent_workers=persistent and workers > 0,
                                        **sampling, **batching)
            return loader, {"loader": loader}

        _resumes_exactly(str(tmp_path_factory.mktemp("any") / "c"), build, save_at)
    finally:
        ITEMS = saved_items


@pytest.mark.parametrize("save_at", [3, 8])
def test_a_duck_typed_batch_samplers_generator_also_in_state_resumes_exactly(tmp_path, save_at):
    """The bucketing batch sampler's generator kept in `state` too (as the README allows for a
    sampler's own generator): it once resumed differently from the first batch on."""
    def build() -> tuple[StatefulDataLoader, dict]:
        loader, state = _loader("duck-bucket-batch-sampler", 0, sampler_in_state=False)
        state["bucket_generator"] = loader.batch_sampler.g
        return loader, state

    _resumes_exactly(str(tmp_path / "c"), build, save_at)

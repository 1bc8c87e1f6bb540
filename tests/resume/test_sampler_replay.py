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
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as TorchdataRandomSampler

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


class SamplerView(Dataset):
    """A sampler's indices seen as a dataset, listed lazily at the first item (Lightning's
    _DatasetSamplerWrapper): the sampler, and its generator, sit under a dataset attribute."""

    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler
        self._indices: list[int] | None = None

    def __len__(self) -> int:
        return len(self._sampler)

    def __getitem__(self, i: int) -> int:
        if self._indices is None:
            self._indices = list(self._sampler)
        return self._indices[i]

    def reset(self) -> None:
        self._indices = None


class DistributedOver(DistributedSampler):
    """A DistributedSampler sharding another sampler's order (Lightning's DistributedSamplerWrapper,
    which Fabric and Lightning put over a loader's sampler): the inner sampler's generator went
    unseen, under `dataset._sampler`, and a resume drew another order, silently."""

    def __init__(self, sampler: Any) -> None:
        super().__init__(SamplerView(sampler), num_replicas=1, rank=0, shuffle=False)

    def __iter__(self):
        self.dataset.reset()
        return (self.dataset[i] for i in super().__iter__())


class Alternating(Sampler[int]):
    """Two samplers, each with its own generator, held in a list (or a dict): their generators
    went unseen and a resume in the second epoch drew another order, silently."""

    def __init__(self, as_dict: bool = False) -> None:
        halves = [RandomSampler(range(ITEMS // 2), generator=torch.Generator().manual_seed(1)),
                  RandomSampler(range(ITEMS // 2), generator=torch.Generator().manual_seed(2))]
        self.samplers: Any = {"a": halves[0], "b": halves[1]} if as_dict else halves

    def __len__(self) -> int:
        return ITEMS

    def __iter__(self):
        halves = list(self.samplers.values()) if isinstance(self.samplers, dict) else self.samplers
        first, second = iter(halves[0]), iter(halves[1])
        for _ in range(ITEMS // 2):
            yield next(first)
            yield ITEMS // 2 + next(second)


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _lightning_wrapper(sampler: Any) -> Any:
    from lightning_fabric.utilities.distributed import DistributedSamplerWrapper

    return DistributedSamplerWrapper(sampler, num_replicas=1, rank=0, shuffle=False)


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
    "samplers-in-a-list": lambda: {"sampler": Alternating()},
    "samplers-in-a-dict": lambda: {"sampler": Alternating(as_dict=True)},
    "distributed-over-random": lambda: {"sampler": DistributedOver(RandomSampler(Items(), generator=_g()))},
    "distributed-over-torchdata-random": lambda: {"sampler": DistributedOver(TorchdataRandomSampler(Items()))},
}
SAMPLERS["lightning-wrapper-over-torchdata-random"] = lambda: {
    "sampler": _lightning_wrapper(TorchdataRandomSampler(Items()))}


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


def _train_with_evaluations(train, val, steps, after_step: Callable[[int], Any]) -> list:
    """A batch of `train` per step (a new pass when one ends), `next(iter(val))` every third step
    (an evaluation that drops its iterator), a draw from the global stream; `after_step(step)`
    (a save) after each. The rows say what each step saw."""
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
        after_step(step)
    return out


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
        return _train_with_evaluations(train, val, steps, lambda step: step == save_at and mgr is not None
                                       and mgr.save(step, state))

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


def _epoch_run(root: str, save_at: int, change_epoch_to: int | None) -> tuple[list, list, list]:
    """A DistributedSampler loop over 3 epochs of 6 batches saved at batch `save_at` (counted over
    the run); the resumed run sets the sampler's epoch to `change_epoch_to` after load_latest (as
    Lightning Fabric's loader wrapper does) or leaves it as restored. Returns the uninterrupted
    batches, the resumed ones and the warnings the resume gave."""
    def build() -> tuple[StatefulDataLoader, dict]:
        sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
        return loader, {"loader": loader, "sampler": sampler}

    loader, state = build()
    reference, taken = [], 0
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load_latest(state)
        for epoch in range(3):
            state["sampler"].set_epoch(epoch)
            for batch in loader:
                reference.append(batch.tolist())
                if taken == save_at:
                    mgr.save(taken, state, epoch=epoch)
                taken += 1
    loader, state = build()
    resumed = []
    with warnings.catch_warnings(record=True) as caught, distckpt.CheckpointManager(root) as mgr:
        warnings.simplefilter("always")
        progress = mgr.load_latest(state)
        for epoch in range(progress.epoch, 3):
            state["sampler"].set_epoch(epoch if change_epoch_to is None or epoch > progress.epoch else change_epoch_to)
            for batch in loader:
                resumed.append(batch.tolist())
    return reference[save_at + 1:], resumed, [w for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]


@pytest.mark.parametrize("save_at", [8, 11])  # mid-epoch; the last batch of epoch 1 (its iterator not yet ended)
def test_a_resumed_pass_in_another_epoch_than_the_saved_one_is_refused_and_can_be_retried(tmp_path, save_at):
    """Lightning Fabric's loader wrapper sets the sampler's epoch to its own count of iter()
    calls, which restarts at 0 in a new process: a mid-epoch position resumed in epoch 0's order
    and every batch after it differed, silently. The resumed iter() now refuses a sampler whose
    epoch is not the saved one; the loop may set the right epoch and iterate again."""
    expected, resumed, caught = _epoch_run(str(tmp_path / "ok"), save_at, None)
    assert resumed == expected and not caught
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="epoch 1 of its sampler, but that sampler's epoch is 0"):
        _epoch_run(str(tmp_path / "changed"), save_at, 0)
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
    with distckpt.CheckpointManager(str(tmp_path / "changed")) as mgr:
        progress = mgr.load_latest({"loader": loader, "sampler": sampler})
    sampler.set_epoch(0)
    with pytest.raises(distckpt.IncompatibleCheckpointError):
        iter(loader)
    sampler.set_epoch(progress.epoch)  # the refusal left the resume planned: the right epoch continues exactly
    retried = [b.tolist() for b in loader]
    for epoch in range(progress.epoch + 1, 3):
        sampler.set_epoch(epoch)
        retried += [b.tolist() for b in loader]
    assert retried == expected


def test_a_pass_after_an_epoch_end_save_starting_an_earlier_epoch_is_warned_about(tmp_path):
    """Saved after a pass ended (the loop's iterator finished), the next pass starts a new
    epoch: a later one is what loops do (nothing said), an earlier one a count restarted."""
    def run(root: str, next_epoch: int) -> list:
        sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
        state = {"loader": loader, "sampler": sampler}
        with distckpt.CheckpointManager(root) as mgr:
            mgr.load_latest(state)
            for epoch in range(2):
                sampler.set_epoch(epoch)
                list(loader)
            mgr.save(1, state, epoch=2)
        sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
        with warnings.catch_warnings(record=True) as caught, distckpt.CheckpointManager(root) as mgr:
            warnings.simplefilter("always")
            mgr.load_latest({"loader": loader, "sampler": sampler})
            sampler.set_epoch(next_epoch)
            list(loader)
        return [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]

    assert run(str(tmp_path / "later"), 2) == []
    said = run(str(tmp_path / "earlier"), 0)
    assert len(said) == 1 and "starts in epoch 0, an earlier one" in said[0] and "Lightning Fabric" in said[0]


@pytest.mark.parametrize("case", ["plain-loader-left-out", "stateful-loader-left-out", "loader-in-state",
                                  "left-out-saved-after-the-pass", "left-out-with-workers",
                                  "another-loader-over-the-dataset-in-state", "validation-loader-broken-off"])
def test_a_loader_left_out_of_state_in_the_middle_of_its_pass_is_warned_about(tmp_path, case):
    """The sampler in `state`, the loader not: a mid-epoch save resumed from the epoch's first
    batch (the batches already taken came again, the run ran longer), silently. Said at the save
    now; nothing is said for a loader in `state` or for a save after the pass ended."""
    from torch.utils.data import DataLoader

    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
    workers = 2 if case == "left-out-with-workers" else 0
    if case == "plain-loader-left-out":
        loader: Any = DataLoader(Items(), batch_size=2, sampler=sampler)
    else:
        data = distckpt.with_worker_rng(Items()) if workers else Items()
        loader = StatefulDataLoader(data, batch_size=2, sampler=sampler, num_workers=workers)
    state: dict[str, Any] = {"sampler": sampler, **({"loader": loader} if case == "loader-in-state" else {})}
    if case == "another-loader-over-the-dataset-in-state":  # a framework iterates a loader it built anew
        state["loader"] = StatefulDataLoader(loader.dataset, batch_size=2, sampler=sampler)
    if case == "validation-loader-broken-off":  # kept by the loader, no pass under way: nothing to say
        state["loader"] = loader
        validation = StatefulDataLoader(Items(), batch_size=2)
    with warnings.catch_warnings(record=True) as caught, distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        warnings.simplefilter("always")
        mgr.load_latest(state)
        for i, _ in enumerate(loader):
            if case == "validation-loader-broken-off":
                for j, _ in enumerate(validation):
                    if j == 1:
                        break
            if i == 2 and case != "left-out-saved-after-the-pass":
                mgr.save(i, state)
        if case == "left-out-saved-after-the-pass":
            mgr.save(6, state, epoch=1)
    said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)
            and "no loader in `state` is iterating it" in str(w.message)]
    if case in ("loader-in-state", "left-out-saved-after-the-pass", "validation-loader-broken-off"):
        assert said == []
    else:
        assert len(said) == 1 and "at batch 3 of 6" in said[0] and "Put the loader in `state`" in said[0]


@pytest.mark.parametrize("buffered", [True, False])
def test_a_hugging_face_iterable_dataset_with_a_shuffle_buffer_is_warned_about_and_one_without_resumes_exactly(
        tmp_path, buffered):
    """datasets' IterableDataset saves where its source is, not its shuffle buffer's content
    (it refills the buffer on load): a resume read other items and fewer of them, with nothing
    raised. Said at the save now; shuffled before streaming, it resumes exactly, unsaid."""
    import datasets

    def build() -> tuple[StatefulDataLoader, Any]:
        source = datasets.Dataset.from_dict({"x": list(range(64))})
        data = (source.to_iterable_dataset(num_shards=2).shuffle(seed=42, buffer_size=16) if buffered
                else source.shuffle(seed=42).to_iterable_dataset(num_shards=2))
        return StatefulDataLoader(data, batch_size=4), data

    loader, data = build()
    reference = []
    with warnings.catch_warnings(record=True) as caught, distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        warnings.simplefilter("always")
        mgr.load_latest({"loader": loader})
        data.set_epoch(0)
        for i, batch in enumerate(loader):
            reference.append(batch["x"].tolist())
            if i in (5, 7):
                mgr.save(i, {"loader": loader})
    said = [str(w.message) for w in caught if "shuffled through a buffer" in str(w.message)]
    assert len(said) == (1 if buffered else 0)  # once per loader
    if buffered:
        assert "buffer_size=16" in said[0] and "Dataset.shuffle(seed=...).to_iterable_dataset()" in said[0]
        return
    loader, data = build()
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        assert mgr.load({"loader": loader}, step=5).step == 5
    data.set_epoch(0)
    assert [batch["x"].tolist() for batch in loader] == reference[6:]


class HoldingBatches:
    """A batch sampler (no Sampler subclass) holding its DistributedSampler as `inner`."""

    def __init__(self, inner: DistributedSampler, size: int) -> None:
        self.inner, self.batch_size = inner, size

    def __iter__(self):
        batch: list[int] = []
        for i in self.inner:
            batch.append(i)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def __len__(self) -> int:
        return (len(self.inner) + self.batch_size - 1) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)


def test_a_distributed_sampler_held_under_any_name_has_its_epoch_checked_at_the_resumed_iter(tmp_path):
    """Only `.sampler` was followed: a DistributedSampler a batch sampler holds as `inner`, its
    epoch set from a count restarting at 0, resumed a mid-epoch position in epoch 0's order."""
    def build() -> tuple[StatefulDataLoader, DistributedSampler, HoldingBatches]:
        sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
        batches = HoldingBatches(sampler, 4)
        return StatefulDataLoader(Items(), batch_sampler=batches), sampler, batches

    loader, sampler, batches = build()
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader, "sampler": sampler})
        for epoch in range(2):
            batches.set_epoch(epoch)
            for i, _ in enumerate(loader):
                if epoch == 1 and i == 1:
                    mgr.save(4, {"loader": loader, "sampler": sampler}, epoch=1)
    loader, sampler, batches = build()
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        assert mgr.load_latest({"loader": loader, "sampler": sampler}).epoch == 1
    batches.set_epoch(0)
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="batch_sampler.inner, but that sampler's epoch is 0"):
        iter(loader)


def test_a_hugging_face_iterable_dataset_starts_each_pass_after_the_resumed_one_at_its_beginning(tmp_path):
    """datasets keeps the position an IterableDataset was loaded with and applies it to every
    pass while its epoch is the saved one: a loop that never calls its set_epoch (no shuffle)
    started every pass after the resume at the saved position, silently."""
    import datasets

    def build() -> StatefulDataLoader:
        source = datasets.Dataset.from_dict({"x": list(range(22))}).to_iterable_dataset(num_shards=2)
        return StatefulDataLoader(source, batch_size=4)

    def passes(loader: StatefulDataLoader, count: int, mgr=None, save_at=None) -> list:
        out = []
        for _ in range(count):
            for batch in loader:
                out.append(batch["x"].tolist())
                if mgr is not None and len(out) == save_at:
                    mgr.save(save_at, {"loader": loader})
        return out

    loader = build()
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader})
        reference = passes(loader, 3, mgr, save_at=4)
    loader = build()
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader})
    resumed = passes(loader, 3)[:len(reference) - 4]
    assert resumed == reference[4:]


@pytest.mark.parametrize("kind", ["torch-batch-sampler", "custom-batch-sampler"])
def test_a_batch_sampler_resumed_with_another_batch_size_is_refused_with_nothing_changed(tmp_path, kind):
    """A batch sampler's position counts its batches: 5 batches of 2 saved, the resume with
    batches of 3 skipped 15 items and never gave 5 of that epoch's items (torchvision's detection
    reference, GroupedBatchSampler). Refused at the load now; the same size resumes exactly."""
    def build(size: int) -> tuple[StatefulDataLoader, DistributedSampler]:
        sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
        batches = BatchSampler(sampler, size, False) if kind == "torch-batch-sampler" else HoldingBatches(sampler, size)
        return StatefulDataLoader(Items(), batch_sampler=batches), sampler

    loader, sampler = build(2)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader, "sampler": sampler})
        taken = []
        for i, batch in enumerate(loader):
            taken += batch.tolist()
            if i == 2:
                mgr.save(2, {"loader": loader, "sampler": sampler})
    loader, sampler = build(3)
    before = {k: v for k, v in vars(loader).items() if k != "_get_iterator"}
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr, \
            pytest.raises(distckpt.IncompatibleCheckpointError, match="saved with batch_size=2 and this one has batch_size=3"):
        mgr.load_latest({"loader": loader, "sampler": sampler})
    assert {k: v for k, v in vars(loader).items() if k != "_get_iterator"} == before
    loader, sampler = build(2)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader, "sampler": sampler})
    assert [x for batch in loader for x in batch.tolist()] == taken[6:]


@pytest.mark.parametrize("setting", ["shuffle", "drop_last"])
@pytest.mark.parametrize("held", ["sampler", "batch-sampler-inner"])
def test_a_distributed_sampler_resumed_with_another_order_setting_is_refused_with_nothing_changed(tmp_path, setting,
                                                                                                   held):
    """A mid-epoch position over DistributedSampler(shuffle=True) resumed into one built with
    shuffle=False gave the items in sequence from the saved count on (items seen before the save
    again, others never), silently; drop_last likewise changes which items the epoch holds."""
    def build(flip: bool) -> tuple[StatefulDataLoader, DistributedSampler]:
        options = {"shuffle": True, "drop_last": False}
        if flip:
            options[setting] = not options[setting]
        sampler = DistributedSampler(Items(), num_replicas=5, rank=1, seed=3, **options)  # 3 items, or 2 dropping
        if held == "sampler":
            return StatefulDataLoader(Items(), batch_size=1, sampler=sampler), sampler
        return StatefulDataLoader(Items(), batch_sampler=HoldingBatches(sampler, 1)), sampler

    loader, sampler = build(False)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        taken = []
        for i, batch in enumerate(loader):
            taken += batch.tolist()
            if i == 0:
                mgr.save(2, {"loader": loader, "sampler": sampler})
    loader, sampler = build(True)
    before = {k: v for k, v in vars(loader).items() if k != "_get_iterator"}
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr, \
            pytest.raises(distckpt.IncompatibleCheckpointError, match=f"saved with {setting}=.* and has {setting}="):
        mgr.load_latest({"loader": loader, "sampler": sampler})
    assert {k: v for k, v in vars(loader).items() if k != "_get_iterator"} == before
    loader, sampler = build(False)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader, "sampler": sampler})
    assert len(taken) == 3 and [x for batch in loader for x in batch.tolist()] == taken[1:]


def _save_a_distributed_position(root: str, batches: int | None, in_state: bool) -> list[int]:
    """Saves after `batches` batches of the first pass, or after the whole pass (None)."""
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
    state: dict = {"loader": loader, **({"sampler": sampler} if in_state else {})}
    taken: list[int] = []
    with distckpt.CheckpointManager(root) as mgr:
        for i, batch in enumerate(loader):
            taken += batch.tolist()
            if batches is not None and i == batches - 1:
                mgr.save(2, state)
                break
        if batches is None:
            mgr.save(2, state)
    return taken


def test_a_loaders_sampler_left_out_of_state_and_built_with_another_seed_is_refused_mid_epoch(tmp_path):
    """The sampler's seed travels with the sampler when it is in `state`; left out, a sampler
    built with another seed resumed the saved position in another order, silently. The resumed
    iter() refuses it now, keeping the position, so the right seed continues exactly."""
    taken = _save_a_distributed_position(str(tmp_path / "c"), 3, in_state=False)
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=4)
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader})
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="saved with seed=3 and has seed=4"):
        iter(loader)
    sampler.seed = 3
    rest = [x for batch in loader for x in batch.tolist()]
    assert rest and sorted(taken[:6] + rest) == list(range(ITEMS))
    full = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
    assert taken[:6] + rest == list(full)


def test_a_sampler_in_state_built_with_another_seed_resumes_with_the_saved_one(tmp_path):
    taken = _save_a_distributed_position(str(tmp_path / "c"), 3, in_state=True)
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=4)
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader, "sampler": sampler})
    with warnings.catch_warnings():
        warnings.simplefilter("error", distckpt.CheckpointWarning)
        rest = [x for batch in loader for x in batch.tolist()]
    assert taken[:6] + rest == list(DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3))


def test_a_loaders_sampler_built_with_another_seed_after_an_epoch_end_save_is_warned_about(tmp_path):
    _save_a_distributed_position(str(tmp_path / "c"), None, in_state=False)
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=4)
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader})
    sampler.set_epoch(1)
    with pytest.warns(distckpt.CheckpointWarning, match="saved with seed=3 and has seed=4"):
        iter(loader)


def test_an_unshuffled_sampler_rebuilt_with_another_seed_resumes_without_a_word(tmp_path):
    """shuffle=False ignores the seed: a validation sampler left out of `state` and rebuilt with
    another seed was refused mid-epoch (and warned about after a dropped iterator), its order
    unchanged."""
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=False, seed=1)
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        it = iter(loader)
        taken = next(it).tolist() + next(it).tolist()
        mgr.save(1, {"loader": loader})
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=False, seed=2)
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load_latest({"loader": loader})
    with warnings.catch_warnings():
        warnings.simplefilter("error", distckpt.CheckpointWarning)
        assert taken + [x for batch in loader for x in batch.tolist()] == list(range(ITEMS))


def _saved_entries(root: str, step: int) -> dict[str, Any]:
    from distckpt.storage import open_storage
    from distckpt.tools.inspection import load_trees
    trees = load_trees(open_storage(root), step)
    return {name: tree["entries"] for name, tree in trees.items() if name.startswith("ranks/")}


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8)
                                                       if b.dim() else b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("workers, persistent, sampling", [
    (0, False, "in-order"), (0, False, "shuffle"), (0, False, "random-global-stream"),
    (0, False, "eager-length-grouped"), (2, False, "shuffle"), (2, True, "shuffle")])
@pytest.mark.parametrize("save_at", [2, 4])  # right after an evaluation that dropped its iterator, and later
def test_a_resumed_loader_saved_before_it_is_iterated_again_is_saved_as_the_uninterrupted_run_saved_it(
        tmp_path, workers, persistent, sampling, save_at):
    # A loader restored after its iterator was dropped (`next(iter(val))`) and saved again before
    # its next iter() was saved as the start of its next pass (state_dict() made that iterator):
    # the same future in other bytes, so `distckpt doctor` said the exact resume "differs" at
    # every save until the next evaluation. The training loader, restored mid-pass and saved
    # before its first batch, is covered too (the save right after the load).
    uninterrupted, resumed = str(tmp_path / "a"), str(tmp_path / "b")

    def build():
        train = StatefulDataLoader(Items(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
        val = StatefulDataLoader(Items(), batch_size=2, num_workers=workers, persistent_workers=persistent,
                                 **VAL_SAMPLING[sampling]())
        return train, val, {"train": train, "val": val}

    def run(train, val, steps, mgr, state):
        return _train_with_evaluations(train, val, steps, lambda step: mgr.save(step, state))

    _seed_all(0)
    train, val, state = build()
    with distckpt.CheckpointManager(uninterrupted, keep_last=100) as mgr:
        assert mgr.load_latest(state) is None
        reference = run(train, val, range(12), mgr, state)
    _seed_all(99)
    train, val, state = build()
    with distckpt.CheckpointManager(uninterrupted) as mgr:
        assert mgr.load(state, step=save_at).step == save_at
    with distckpt.CheckpointManager(resumed, keep_last=100) as mgr:
        mgr.save(save_at, state)  # right after the load, nothing iterated
        assert run(train, val, range(save_at + 1, 12), mgr, state) == reference[save_at + 1:]
    for step in range(save_at, 12):
        before, after = _saved_entries(uninterrupted, step), _saved_entries(resumed, step)
        assert list(before) == list(after)
        for name in before:
            for key in ("train", "val"):
                assert _bitwise_equal(before[name][key], after[name][key]), (step, key)


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("sampling", ["in-order", "shuffle", "shuffle-own-generator", "random-global-stream"])
def test_a_loader_saved_before_its_first_pass_resumes_exactly(tmp_path, workers, persistent, sampling):
    # torchdata's state_dict() made the first iterator inside the save, drawing its base seed from
    # the global stream after the streams were captured: the uninterrupted run was a draw ahead of
    # every resume (every later torch.rand, dropout mask... differed, silently).
    root = str(tmp_path / "c")
    options = {"in-order": {}, "shuffle": {"shuffle": True},
               "shuffle-own-generator": {"shuffle": True, "generator": torch.Generator().manual_seed(5)},
               "random-global-stream": {"sampler": RandomSampler(Items())}}

    def build():
        fresh = {k: (torch.Generator().manual_seed(5) if k == "generator" else v)
                 for k, v in options[sampling].items()}
        if sampling == "random-global-stream":
            fresh["sampler"] = RandomSampler(Items())
        val = StatefulDataLoader(Items(), batch_size=2, num_workers=workers, persistent_workers=persistent, **fresh)
        return val, {"val": val, "x": torch.zeros(1)}

    def run(val, steps, mgr=None, state=None):
        out = []
        for step in steps:
            drawn = torch.rand(1).item()
            out.append((step, drawn, [b.tolist() for b in val] if step == 4 else None))  # the first evaluation
            if mgr is not None:
                mgr.save(step, state)
        return out

    _seed_all(0)
    val, state = build()
    with distckpt.CheckpointManager(root, keep_last=10) as mgr:
        assert mgr.load_latest(state) is None
        reference = run(val, range(7), mgr, state)
    for resume_at in (0, 1, 3, 5):  # 0: the save that made its first iterator
        _seed_all(99)
        val, state = build()
        with distckpt.CheckpointManager(root) as mgr:
            assert mgr.load(state, step=resume_at).step == resume_at
        assert run(val, range(resume_at + 1, 7)) == reference[resume_at + 1:], resume_at

"""Loop patterns in one process: loaders with and without a generator, with and without
workers, saved at any position, and an async save left in flight at exit."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 16  # two epochs of 8 batches


class RandomAugmented(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


class RandomStream(IterableDataset):
    """16 items a pass, split between the loader's workers, each drawn from torch's, Python's and
    NumPy's global streams (of the worker, or of the main process without workers), no state_dict."""

    def __iter__(self):
        info = get_worker_info()
        mine = range(16) if info is None else range(info.id, 16, info.num_workers)
        for i in mine:
            yield torch.tensor([float(i) + torch.rand(1).item(), random.random(), float(np.random.rand())])


def _loader(workers: int, generator: bool, shuffle: bool, iterable: bool = False,
            generator_in_state: bool = True) -> tuple[StatefulDataLoader, dict]:
    if iterable:  # wrapped without workers too: the replay to the position must not move the streams
        dataset: Any = distckpt.with_worker_rng(RandomStream())
        shuffle = False
    else:
        dataset = distckpt.with_worker_rng(RandomAugmented()) if workers else RandomAugmented()
    g = torch.Generator().manual_seed(5) if generator else None
    loader = StatefulDataLoader(dataset, batch_size=2, shuffle=shuffle, num_workers=workers, generator=g)
    state: dict = {"loader": loader}
    if g is not None and generator_in_state:
        state["loader_generator"] = g
    return loader, state


def _run(loader: StatefulDataLoader, steps: range, save_at: int | None = None,
         mgr: distckpt.CheckpointManager | None = None, state: dict | None = None) -> list[tuple]:
    """Each step's batch and one draw of the global torch stream (what the step's dropout sees)."""
    out = []
    it = iter(loader)
    for step in steps:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        out.append((step, batch.tolist(), torch.rand(1).item()))
        if step == save_at and mgr is not None and state is not None:
            mgr.save(step, state)
    return out


def _check_resume(tmp_path, workers: int, generator: bool, shuffle: bool, save_at: int, iterable: bool = False,
                  generator_in_state: bool = True) -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    loader, state = _loader(workers, generator, shuffle, iterable, generator_in_state)
    root = str(tmp_path / f"c{workers}{generator}{shuffle}{save_at}{iterable}")
    with distckpt.CheckpointManager(root) as mgr:
        reference = _run(loader, range(STEPS), save_at, mgr, state)
    torch.manual_seed(99)  # the resumed process starts from other streams
    random.seed(99)
    np.random.seed(99)
    loader, state = _loader(workers, generator, shuffle, iterable, generator_in_state)
    if loader.generator is not None:
        loader.generator.manual_seed(77)  # built otherwise than the run's: only the checkpoint can put it back
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load_latest(state)
    assert progress is not None and progress.step == save_at
    resumed = _run(loader, range(save_at + 1, STEPS))
    assert resumed == reference[save_at + 1:]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True], ids=["no-generator", "generator"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
def test_a_loader_resumed_mid_epoch_continues_every_stream(tmp_path, workers, generator, shuffle):
    # Without generator= (the default) the base seed comes from torch's global stream: the
    # resumed iterator used to draw it a second time (12 of 16 steps differed with 2 workers).
    _check_resume(tmp_path, workers, generator, shuffle, save_at=4)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save_at", [4, 7])
def test_a_loaders_own_generator_travels_with_the_loader(tmp_path, workers, save_at):
    # generator= given to the loader and not put in `state` too: the next epoch's shuffle used to
    # differ from the uninterrupted run's (the loader's state does not hold its generator).
    _check_resume(tmp_path, workers, generator=True, shuffle=True, save_at=save_at, generator_in_state=False)


@pytest.mark.parametrize("saved, resumed", [(0, 2), (2, 0), (2, 1)])
def test_a_loader_with_another_number_of_workers_is_refused_with_nothing_changed(tmp_path, saved, resumed):
    # torchdata cannot resume a position across worker counts: accepted, the next iter() failed
    # with a bare AssertionError after everything else had been restored.
    loader, state = _loader(saved, generator=True, shuffle=True)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        _run(loader, range(3), 2, mgr, {**state, "weights": torch.arange(3.0)})
    loader, state = _loader(resumed, generator=True, shuffle=True)
    weights = torch.zeros(3)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match=f"num_workers={saved}.*num_workers={resumed}"):
            mgr.load_latest({**state, "weights": weights})
    assert torch.equal(weights, torch.zeros(3))
    assert len(_run(loader, range(8))) == 8  # the loader is as built: a fresh pass works


class _Shorter(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.tensor([float(i)])


@pytest.mark.parametrize("change", ["shuffle", "dataset-length"])
def test_a_loader_over_another_sampler_or_dataset_length_is_refused_with_nothing_changed(tmp_path, change):
    """shuffle=False over a shuffled position failed at the next iter() with a bare AssertionError
    from torchdata; a dataset of another length continued another permutation (items seen before
    the save came again), silently."""
    loader, state = _loader(0, generator=True, shuffle=True)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        _run(loader, range(3), 2, mgr, {**state, "weights": torch.arange(3.0)})
    if change == "shuffle":
        loader, state = _loader(0, generator=True, shuffle=False)
        said = "saved with sampler RandomSampler and this one has SequentialSampler"
    else:
        loader = StatefulDataLoader(_Shorter(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
        state = {"loader": loader, "loader_generator": loader.generator}
        said = "the loader's dataset has 6 items and had 16 when saved"
    weights = torch.zeros(3)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match=said):
            mgr.load_latest({**state, "weights": weights})
    assert torch.equal(weights, torch.zeros(3))
    assert len(list(loader)) == len(loader)  # the loader is as built: a fresh pass works


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save_at", [0, 3, 7, 8])
def test_an_iterable_dataset_without_state_dict_resumes_at_its_position(tmp_path, workers, save_at):
    # with_worker_rng keeps the position of an IterableDataset that has no state_dict: it used to
    # start over from its first item (every step after the resume differed). 7: the last batch of
    # the first pass, so the resumed loader starts the second pass, not a replay.
    _check_resume(tmp_path, workers, generator=False, shuffle=False, save_at=save_at, iterable=True)


@settings(max_examples=int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "6")), deadline=None, derandomize=True)
@given(workers=st.sampled_from([0, 2]), generator=st.booleans(), shuffle=st.booleans(),
       save_at=st.integers(min_value=0, max_value=STEPS - 2), iterable=st.booleans())
def test_a_loader_saved_at_any_position_resumes_exactly(tmp_path_factory, workers, generator, shuffle, save_at, iterable):
    # Every position: the first batch of an epoch, mid-epoch, the last batch of an epoch.
    _check_resume(tmp_path_factory.mktemp("pos"), workers, generator, shuffle, save_at, iterable)


def test_an_async_save_in_flight_at_exit_without_close_is_finished_and_said(tmp_path):
    script = ("import sys, torch, distckpt\n"
              "mgr = distckpt.CheckpointManager(sys.argv[1], async_save=True)\n"
              "mgr.save(3, {'w': torch.randn(1 << 22)})\n")  # 16 MiB: still writing at exit
    root = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr
    assert "without CheckpointManager.close()" in result.stderr
    assert "finished at exit" in result.stderr
    assert (root / "step-000000003" / "COMMITTED").exists()
    with distckpt.CheckpointManager(str(root)) as mgr:
        state = {"w": torch.zeros(1 << 22)}
        assert mgr.load_latest(state).step == 3


def test_an_async_save_failing_at_exit_is_reported_as_an_error(tmp_path):
    # The background write fails after save() returned (a fault at a named point of the write).
    script = ("import sys, torch, distckpt\n"
              "from distckpt.runtime import faults\n"
              "def fail(name, ctx):\n"
              "    if name == 'save/replicated-written':\n"
              "        raise OSError(28, 'No space left on device')\n"
              "faults.on_point(fail)\n"
              "mgr = distckpt.CheckpointManager(sys.argv[1], async_save=True)\n"
              "mgr.save(3, {'w': torch.randn(1000)})\n")
    root = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert "FAILED at exit and is not committed" in result.stderr, result.stderr
    assert "No space left on device" in result.stderr
    assert not (root / "step-000000003" / "COMMITTED").exists()


def _epoch_snapshot_run(root, stop_after_epoch=None):
    """A per-epoch snapshot taken after `for batch in loader` ended, as the README says: epoch + 1."""
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(8))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)
    state = {"sampler": sampler, "loader": loader}
    seen = []
    with distckpt.CheckpointManager(str(root)) as mgr:
        progress = mgr.load_latest(state)
        step = progress.step + 1 if progress else 0
        for epoch in range(progress.epoch if progress else 0, 3):
            sampler.set_epoch(epoch)
            for batch in loader:
                seen.append((step, epoch, batch.tolist()))
                step += 1
            mgr.save(step - 1, state, epoch=epoch + 1)
            if epoch == stop_after_epoch:
                break
    return seen


def test_a_snapshot_after_the_epochs_loop_resumes_with_the_next_epoch(tmp_path):
    reference = _epoch_snapshot_run(tmp_path / "ref")
    first = _epoch_snapshot_run(tmp_path / "run", stop_after_epoch=0)
    resumed = _epoch_snapshot_run(tmp_path / "run")
    assert first + resumed == reference


def test_an_unwrapped_iterable_dataset_in_the_main_process_resumes_exactly(tmp_path):
    """torchdata replays an IterableDataset without state_dict in this process item by item: the
    replay runs from the streams its epoch started with and leaves them as saved. It once drew
    from the restored streams and left Python's and NumPy's moved (every step after differed).
    An epoch that started before the manager saw the loader is said once (a ReplayWarning)."""
    import warnings

    def run(seen_first: bool, save_at: int | None, root: str) -> tuple[list, list]:
        torch.manual_seed(0)
        loader = StatefulDataLoader(RandomStream(), batch_size=2)
        with distckpt.CheckpointManager(root) as mgr, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if seen_first:
                assert mgr.load_latest({"loader": loader}) is None
            out = _run(loader, range(STEPS), save_at, mgr, {"loader": loader})
        return out, [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]

    for seen_first in (False, True):
        root = str(tmp_path / f"w{seen_first}")
        reference, said = run(seen_first, 5, root)
        assert len(said) == (0 if seen_first else 1), said
        assert seen_first or "started before the checkpoint manager saw the loader" in said[0]
        torch.manual_seed(99)
        loader = StatefulDataLoader(RandomStream(), batch_size=2)
        with distckpt.CheckpointManager(root) as mgr:
            assert mgr.load_latest({"loader": loader}).step == 5
        resumed = _run(loader, range(6, STEPS))
        assert resumed == reference[6:]


class Plain(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def random_crop_and_mask(items: list) -> torch.Tensor:
    """A collate_fn that draws, as Hugging Face's language-modelling collators do, in the worker."""
    batch = torch.stack(items)
    keep = random.randint(0, 3) + float(np.random.rand())
    return torch.cat([batch + keep, torch.rand(len(items), 1)], dim=1)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_collate_fn_drawing_in_the_workers_resumes_exactly_with_the_dataset_wrapped(tmp_path, workers):
    """__getitem__ draws nothing; the collate_fn does (in the workers when there are some).
    Without the wrapper the 2-worker case differs after the resume (checked by hand)."""
    def make() -> tuple[StatefulDataLoader, dict]:
        loader = StatefulDataLoader(distckpt.with_worker_rng(Plain()), batch_size=2, shuffle=True,
                                    num_workers=workers, collate_fn=random_crop_and_mask)
        return loader, {"loader": loader}

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    loader, state = make()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        reference = _run(loader, range(STEPS), 5, mgr, state)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    loader, state = make()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest(state).step == 5
    assert _run(loader, range(6, STEPS)) == reference[6:]


_PREEMPTED_LOOP = '''
import os, signal, sys, torch, distckpt
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

root, notice_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [torch.tensor([float(i), 1.0]) for i in range(8)]
sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
loader = StatefulDataLoader(data, batch_size=2, sampler=sampler)
state = {"model": model, "optimizer": opt, "sampler": sampler, "loader": loader}
epochs, every = 3, 3
mgr = distckpt.CheckpointManager(root)
progress = mgr.load_latest(state)
step = progress.step + 1 if progress else 0
last_saved = progress.step if progress else -1
with open(out, "a") as log:
    for epoch in range(progress.epoch if progress else 0, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            model(batch).pow(2).mean().backward()
            opt.step()
            log.write(f"{step} {epoch} {batch.tolist()} {model.weight.sum().item().hex()}\\n")
            if step == notice_at:
                os.kill(os.getpid(), signal.SIGTERM)
            preempted = mgr.preemption_requested()
            if (step + 1) % every == 0 or preempted:
                mgr.save(step, state, epoch=epoch)
                last_saved = step
            if preempted:
                mgr.close()
                sys.exit(distckpt.PREEMPTED_EXIT_CODE)
            step += 1
        log.write(f"epoch {epoch} ends at {step - 1}\\n")
        if last_saved != step - 1:
            mgr.save(step - 1, state, epoch=epoch + 1)
            last_saved = step - 1
mgr.close()
'''


def test_a_notice_during_an_epochs_last_step_resumes_and_finishes_with_the_readme_loop(tmp_path):
    """The in-loop pre-emption save takes the epoch's last step; the relaunch finds the loader
    exhausted and reaches the per-epoch save of that step, which a job counting saves in the
    process only made fail at every relaunch (CheckpointExistsError)."""
    script = tmp_path / "loop.py"
    script.write_text(_PREEMPTED_LOOP)

    def run(root, notice_at, out):
        return subprocess.run([sys.executable, str(script), str(root), str(notice_at), str(out)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})

    reference = run(tmp_path / "ref", -1, tmp_path / "ref.log")
    assert reference.returncode == 0, reference.stderr
    first = run(tmp_path / "run", 7, tmp_path / "run.log")  # step 7 is epoch 1's last
    assert first.returncode == distckpt.PREEMPTED_EXIT_CODE, first.stderr
    relaunch = run(tmp_path / "run", -1, tmp_path / "run.log")
    assert relaunch.returncode == 0, relaunch.stderr
    # the same steps, batches and weights; epoch 1's end run once, by the relaunch
    assert (tmp_path / "run.log").read_text() == (tmp_path / "ref.log").read_text()
    with distckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        assert mgr.committed_steps() == [11, 8, 7, 5, 3, 2]


class _WithTransform(Dataset):
    def __init__(self):
        self.transform = None

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i if self.transform is None else self.transform(i)


class _IterableWithTransform(IterableDataset):
    def __init__(self):
        self.transform = None

    def __iter__(self):
        return iter(i if self.transform is None else self.transform(i) for i in range(4))


@pytest.mark.parametrize("inner", [_WithTransform, _IterableWithTransform])
def test_attributes_set_through_with_worker_rng_reach_the_dataset(inner):
    """`loader.dataset.transform = ...` landed on the wrapper: reading it back looked right while
    the dataset kept its old transform (the batches were [0, 1, 2, 3], not [0, 10, 20, 30])."""
    dataset = inner()
    wrapped = distckpt.with_worker_rng(dataset)
    wrapped.transform = lambda i: 10 * i
    assert dataset.transform is wrapped.transform
    loader = StatefulDataLoader(wrapped, batch_size=4, num_workers=0)
    assert next(iter(loader)).tolist() == [0, 10, 20, 30]
    del wrapped.transform
    assert not hasattr(dataset, "transform") and not hasattr(wrapped, "transform")


def _peek_loader(workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    g = torch.Generator().manual_seed(3)
    data = distckpt.with_worker_rng(list(range(40))) if workers else list(range(40))
    return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=g, num_workers=workers)


def _peek_pass(loader, peek: bool, mgr=None, save_at=None) -> list:
    """One pass; with `peek`, the PyTorch DDP tutorial's `b_sz = len(next(iter(loader))[0])` first."""
    out = []
    if peek:
        next(iter(loader))
    for i, batch in enumerate(loader):
        out.append(batch.tolist())
        if i == save_at:
            mgr.save(1, {"loader": loader})  # mid-pass, its iterator held by this loop
            return out
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("peek", [True, False])
def test_a_peek_at_the_epochs_start_after_a_mid_epoch_resume_is_said(tmp_path, workers, peek):
    """The peek takes the resumed position and the loop's own iterator starts the pass over: every
    step after a resume differed, with no word (the PyTorch DDP tutorial's Trainer). A warning
    now names it; without the peek the pass continues exactly and nothing is said."""
    reference = _peek_pass(_peek_loader(workers), peek)
    loader = _peek_loader(workers)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest({"loader": loader})
        before = _peek_pass(loader, peek, mgr, save_at=3)
    loader = _peek_loader(workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(str(tmp_path)) as mgr:
            mgr.load_latest({"loader": loader})
        after = _peek_pass(loader, peek)
    said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]
    if peek:
        assert before + after != reference  # what the warning is about
        assert len(said) == 1 and "resumed mid-pass (at batch 4)" in said[0] and "loader.batch_size" in said[0], said
    else:
        assert before + after == reference and said == [], said

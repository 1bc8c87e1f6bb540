"""Random streams inside data-loader worker processes, carried in the loader's state.

Each worker seeds Python `random`, torch's default generator and NumPy's global generator from
the loader's base seed when an epoch's iterator starts. `StatefulDataLoader` restores the base
seed and position on resume but re-seeds those streams, so draws made in workers (augmentation)
after a mid-epoch resume differ from the uninterrupted run. `with_worker_rng(dataset)` makes the
dataset Stateful: `StatefulDataLoader` asks it for `state_dict()` inside each worker, and hands
the state back to `load_state_dict()` in the worker of the resumed run.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Iterator

from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .rng import capture_process_rng, restore_process_rng

_INNER = "dataset"
_RNG = "worker_rng"
_POSITION = "yielded"  # items the iterator had yielded (an inner dataset without state_dict)


class _WorkerRngMixin:
    dataset: Any

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if get_worker_info() is not None:  # in the main process the manager owns the streams
            out[_RNG] = capture_process_rng()
        if callable(getattr(self.dataset, "state_dict", None)):
            out[_INNER] = self.dataset.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shield_from_preemption()
        info = get_worker_info()
        if info is not None and _RNG in state:
            restore_process_rng(state[_RNG], f"data-loader worker {info.id}")
        if _INNER in state:
            self.dataset.load_state_dict(state[_INNER])


class WorkerRngDataset(_WorkerRngMixin, Dataset):
    """A map-style dataset whose worker random streams travel in the loader's state."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        shield_from_preemption()
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class WorkerRngIterableDataset(_WorkerRngMixin, IterableDataset):
    """An iterable dataset whose worker random streams, and position, travel in the loader's state.

    Being Stateful, the wrapper turns off torchdata's own fast-forward (which replays the items
    already yielded), so it keeps the position itself: how many items the current iterator has
    yielded. An inner dataset with state_dict restores its own position; any other is replayed
    to it by the first iterator after a load, with every random stream of the process saved
    before the replay and put back after it: the items after the resume are drawn from the
    streams as they were at the save, as in the uninterrupted run (the replay's own draws are
    discarded with its items). Without this the resumed iterator started over from the first
    item (a 2-worker run differed from the first step after the resume)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._yielded = 0        # by the current iterator
        self._exhausted = False  # the current iterator ran out: the next one starts a new pass
        self._replay = 0         # items the next iterator skips (set by load_state_dict)

    def __iter__(self) -> Iterator[Any]:
        shield_from_preemption()
        replay, self._replay = self._replay, 0
        self._yielded, self._exhausted = 0, False
        inner = iter(self.dataset)
        if replay:
            streams = capture_process_rng()
            try:
                for _ in range(replay):
                    next(inner)
                    self._yielded += 1
            except StopIteration:
                self._exhausted = True
                return
            finally:
                restore_process_rng(streams, "data-loader replay")
        for item in inner:
            self._yielded += 1
            yield item
        self._exhausted = True

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if _INNER not in out:
            out[_POSITION] = 0 if self._exhausted else self._yielded
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._replay = int(state.get(_POSITION, 0))


def with_worker_rng(dataset: Any) -> Dataset:
    """Wrap `dataset` so each loader worker's Python/NumPy/torch streams are saved and restored."""
    if isinstance(dataset, IterableDataset):
        return WorkerRngIterableDataset(dataset)
    return WorkerRngDataset(dataset)


# Pre-emption signals a manager of this process records (preemption.py), with the recording
# process: a DataLoader worker forked from it inherits this table.
_PREEMPTION_SIGNALS: dict[int, int] = {}
_SHIELDED_IN: list[int] = []  # the worker process that already ignores them


def note_preemption_signals(signals: tuple[int, ...]) -> None:
    for sig in signals:
        _PREEMPTION_SIGNALS[sig] = os.getpid()


def shield_from_preemption() -> None:
    """In a loader worker of a rank that records pre-emption signals: ignore them. torchrun and
    Kubernetes signal the rank's whole process group, and torch's worker handler ends a worker
    at SIGTERM: the rank's next batch raised "DataLoader worker is killed by signal: Terminated"
    before the step boundary where the pre-emption save runs (3 of 4 two-worker runs). A worker
    that outlives the notice ends with the rank (the loader's watchdog sees its parent gone)."""
    pid = os.getpid()
    if _SHIELDED_IN == [pid] or not _PREEMPTION_SIGNALS or get_worker_info() is None:
        return
    _SHIELDED_IN[:] = [pid]
    for sig, recorder in _PREEMPTION_SIGNALS.items():
        if recorder != pid:
            try:
                signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the worker's main thread: nothing to do from here
                pass

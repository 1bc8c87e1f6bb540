"""Random streams inside data-loader worker processes, carried in the loader's state.

Each worker seeds Python `random`, torch's default generator and NumPy's global generator from
the loader's base seed when an epoch's iterator starts. `StatefulDataLoader` restores the base
seed and position on resume but re-seeds those streams, so draws made in workers (augmentation)
after a mid-epoch resume differ from the uninterrupted run. `with_worker_rng(dataset)` makes the
dataset Stateful: `StatefulDataLoader` asks it for `state_dict()` inside each worker, and hands
the state back to `load_state_dict()` in the worker of the resumed run.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import Dataset, IterableDataset, get_worker_info

from distckpt.config import arguments_checked
from distckpt.errors import ConfigError
from distckpt.runtime.iterators import track_iterators
from distckpt.runtime.worker_signals import preemption_safe_worker_init, shield_from_preemption  # noqa: F401
from distckpt.state.rng import capture_process_rng, restore_process_rng

_INNER = "dataset"
_RNG = "worker_rng"
_POSITION = "yielded"  # items the iterator had yielded (an inner dataset without state_dict)
_PASS_START = "pass_start"  # the process's streams when that iterator started: its replay starts there
_ENDED = "pass_ended"  # that iterator had run out: the resumed one yields nothing (a new pass is the next's)


def _capture() -> dict[str, Any]:
    """This process's streams; in a loader worker the CPU ones only (see capture_process_rng)."""
    return capture_process_rng(devices=get_worker_info() is None)


def _restore(state: dict[str, Any], where: str) -> None:
    restore_process_rng(state, where, devices=get_worker_info() is None)


class _WorkerRngMixin:
    dataset: Any
    _OWN: frozenset[str] = frozenset({"dataset"})  # the wrapper's own attributes; any other is the dataset's

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._OWN or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # `loader.dataset.transform = ...` (timm's create_loader style) set the attribute on the
        # wrapper, where reading it back looked right while the dataset used its old transform
        if name in type(self)._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __delattr__(self, name: str) -> None:
        if name in type(self)._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if get_worker_info() is not None:  # in the main process the manager owns the streams
            out[_RNG] = _capture()
        if callable(getattr(self.dataset, "state_dict", None)):
            out[_INNER] = self.dataset.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shield_from_preemption()
        info = get_worker_info()
        if info is not None and _RNG in state:
            _restore(state[_RNG], f"data-loader worker {info.id}")
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

    _OWN = frozenset({"dataset", "_yielded", "_exhausted", "_replay", "_pass_start", "_replay_start", "_replay_ended"})

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._yielded = 0        # by the current iterator
        self._exhausted = False  # the current iterator ran out: the next one starts a new pass
        self._replay = 0         # items the next iterator skips (set by load_state_dict)
        self._pass_start: Any = None    # the streams when the current iterator started
        self._replay_start: Any = None  # the saved pass's start (set by load_state_dict)
        self._replay_ended = False      # the saved pass had ended (set by load_state_dict)

    def __iter__(self) -> Iterator[Any]:
        # The flags are taken here, not in the generator: torchdata may never advance the
        # resumed iterator of a worker whose pass had ended, and a flag left set would end
        # that worker's next pass before it began.
        replay, self._replay = self._replay, 0
        replay_start, self._replay_start = self._replay_start, None
        if self._replay_ended:
            # The worker's share of the pass had been handed over before the save: the resumed
            # iterator yields nothing (it started the share again, repeating it inside the epoch).
            self._replay_ended, self._yielded, self._exhausted = False, 0, True
            return iter(())
        return self._pass(replay, replay_start)

    def _pass(self, replay: int, replay_start: Any) -> Iterator[Any]:
        shield_from_preemption()
        self._yielded, self._exhausted = 0, False
        at_save = _capture() if replay else None
        if replay and replay_start is not None:
            # A dataset that draws when its pass starts (a shuffle of its shard) replays the saved
            # pass from the streams that pass started with; from the save's it drew another order.
            _restore(replay_start, "data-loader replay")
        self._pass_start = replay_start if replay and replay_start is not None else _capture()
        inner = iter(self.dataset)
        if replay:
            try:
                for _ in range(replay):
                    next(inner)
                    self._yielded += 1
            except StopIteration:
                self._exhausted = True
                return
            finally:
                assert at_save is not None
                _restore(at_save, "data-loader replay")
        for item in inner:
            self._yielded += 1
            yield item
        self._exhausted = True

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if _INNER not in out:
            out[_POSITION] = 0 if self._exhausted else self._yielded
            if self._exhausted:
                out[_ENDED] = True
            if out[_POSITION] and self._pass_start is not None:
                out[_PASS_START] = self._pass_start
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._replay = int(state.get(_POSITION, 0))
        self._replay_start = state.get(_PASS_START)
        self._replay_ended = state.get(_ENDED) is True


@arguments_checked
def with_worker_rng(dataset: Any) -> Dataset:
    """Wrap `dataset` so each loader worker's Python/NumPy/torch streams are saved and restored."""
    if not isinstance(dataset, IterableDataset) and not callable(getattr(dataset, "__getitem__", None)):
        raise ConfigError(f"dataset={type(dataset).__name__}: must be a dataset (with __getitem__, or an "
                          "IterableDataset), the one the DataLoader is given")
    track_iterators()  # the loader over it is built next: the saves' loader checks see its iterators
    if isinstance(dataset, IterableDataset):
        return WorkerRngIterableDataset(dataset)
    return WorkerRngDataset(dataset)

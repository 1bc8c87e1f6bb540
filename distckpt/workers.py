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

from .rng import capture_process_rng, restore_process_rng

_INNER = "dataset"
_RNG = "worker_rng"


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
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class WorkerRngIterableDataset(_WorkerRngMixin, IterableDataset):
    """An iterable dataset whose worker random streams travel in the loader's state."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)


def with_worker_rng(dataset: Any) -> Dataset:
    """Wrap `dataset` so each loader worker's Python/NumPy/torch streams are saved and restored."""
    if isinstance(dataset, IterableDataset):
        return WorkerRngIterableDataset(dataset)
    return WorkerRngDataset(dataset)

"""An evaluation loader with persistent workers, left out of `state`, is named at the save whenever
its iterator was made — also before the first CheckpointManager: by Accelerate's `prepare` (which
makes a torchdata loader's iterator at once), by an evaluation pass the script runs before it builds
the manager. Tracking begins at `init_distributed()` or `with_worker_rng()`, whichever the script
calls first; a loader in `state` is never named. World of one, in this process, one worker."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import distckpt


class Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.rand(4), "y": i % 2}


def _named(caught: list) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, distckpt.CheckpointWarning) and "persistent workers is not in `state`" in str(w.message)]


def _train_and_save(tmp_path, model, opt, loader, evaluate, state) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
            mgr.load_latest(state)
            for step, batch in enumerate(loader):
                nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
                opt.step()
                opt.zero_grad()
                if step == 1:
                    evaluate()
                mgr.save(step, state)
    return _named(caught)


def _eval_loader(generator: torch.Generator | None, worker_rng: bool) -> torch.utils.data.DataLoader:
    data = distckpt.with_worker_rng(Pairs()) if worker_rng else Pairs()
    return torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True, generator=generator)


@pytest.mark.parametrize("in_state", [False, True])
def test_an_accelerate_prepared_evaluation_loader_is_named_when_left_out(tmp_path, in_state):
    """Accelerate's prepare makes the evaluation loader's iterator before the manager exists: it
    escaped the check (an independent check saw every evaluation after a resume differ, silently)."""
    pytest.importorskip("accelerate")
    from distckpt.integrations import accelerate as dca

    accelerator = dca.make_accelerator()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=4, shuffle=True)
    model, opt, loader, evaluation = accelerator.prepare(model, opt, loader, _eval_loader(None, worker_rng=False))
    state = {"model": model, "optimizer": opt, "loader": loader}
    if in_state:
        state["eval_loader"] = evaluation
    named = _train_and_save(tmp_path, model, opt, loader, lambda: list(evaluation), state)
    assert (named == []) if in_state else (len(named) == 1 and "drew its workers' base seed" in named[0]), named


@pytest.mark.parametrize("generator", [None, "own"])
def test_an_evaluation_pass_before_the_manager_is_named(tmp_path, generator):
    """The script evaluates once before it builds the manager (a baseline metric), after
    init_distributed(). with_worker_rng says its workers draw: their streams restart in a resumed
    process, with or without a generator of the loader's own."""
    distckpt.init_distributed()
    evaluation = _eval_loader(torch.Generator().manual_seed(3) if generator else None, worker_rng=True)
    list(evaluation)  # before any manager
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(Pairs(), batch_size=4, shuffle=True)
    state = {"model": model, "optimizer": opt, "loader": loader}
    named = _train_and_save(tmp_path, model, opt, loader, lambda: list(evaluation), state)
    assert len(named) == 1, named
    # whatever its generator: its workers' streams restart in a resumed process, which a generator of
    # its own does not help, so the save does not offer one
    assert "with_worker_rng" in named[0] and "generator of its own" not in named[0], named[0]


def test_a_persistent_loader_with_its_own_generator_and_no_worker_draws_is_not_named(tmp_path):
    """Nothing to say: its base seed is its own generator's and its workers draw nothing we know of."""
    distckpt.init_distributed()
    evaluation = _eval_loader(torch.Generator().manual_seed(3), worker_rng=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(Pairs(), batch_size=4, shuffle=True)
    state = {"model": model, "optimizer": opt, "loader": loader}
    assert _train_and_save(tmp_path, model, opt, loader, lambda: list(evaluation), state) == []


@pytest.mark.parametrize("first_call", ["distckpt.init_distributed()", "distckpt.with_worker_rng(Pairs())", ""])
def test_tracking_begins_at_the_first_call_that_precedes_the_loaders(first_call):
    """In a fresh process (the tracking is process-wide, so the tests above cannot show where it
    begins): an iterator made after init_distributed() or with_worker_rng() is seen, one made before
    any distckpt call is not (the guides say to call init_distributed first)."""
    import subprocess

    code = "\n".join([
        "import torch, distckpt",
        "from distckpt.runtime.iterators import tracked_iterators",
        "class Pairs(torch.utils.data.Dataset):",
        "    def __len__(self): return 4",
        "    def __getitem__(self, i): return i",
        first_call,
        "it = iter(torch.utils.data.DataLoader(Pairs()))",
        "print(any(t is it for t in tracked_iterators()))",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("True" if first_call else "False")

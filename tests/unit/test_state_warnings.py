"""Warnings about what is saved or restored (distckpt/state/) are reported at the user's own line
(the save or load call), however deep the library found the hazard, and said once: no bare
logging line printed before the warning when logging is not configured."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt


def _unwrapped_worker_loader(url: str):
    """A loader with workers over a dataset not wrapped with with_worker_rng: warned at save."""
    loader = StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(16.0)), batch_size=4, num_workers=2)
    return {"loader": loader}, {"loader": loader}


def _entries_left_out(url: str):
    """A checkpoint holding an entry the loading `state` lacks: warned at load (not restored)."""
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(0, {"w": torch.zeros(2), "extra": 1})
    return None, {"w": torch.zeros(2)}


@pytest.mark.parametrize("make, category", [
    (_unwrapped_worker_loader, distckpt.CheckpointWarning),
    (_entries_left_out, distckpt.CheckpointWarning),
])
def test_a_state_warning_points_at_the_users_save_or_load_line(tmp_path, make, category):
    url = str(tmp_path / "c")
    to_save, to_load = make(url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(url) as mgr:
            if to_save is not None:
                mgr.save(1, to_save); line = sys._getframe().f_lineno  # noqa: E702  (the call's own line)
            else:
                mgr.load_latest(to_load); line = sys._getframe().f_lineno  # noqa: E702  (the call's own line)
    said = [(w.filename, w.lineno) for w in caught if issubclass(w.category, category)]
    assert said == [(__file__, line)], [(w.category.__name__, w.filename, w.lineno, str(w.message)[:80]) for w in caught]


_SCRIPT = """
import sys, torch, distckpt
from torchdata.stateful_dataloader import StatefulDataLoader
loader = StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(16.0)), batch_size=4, num_workers=2)
mgr = distckpt.CheckpointManager(sys.argv[1])
mgr.save(0, {"loader": loader})
mgr.close()
"""


def test_the_unwrapped_workers_warning_is_said_once_at_the_users_save_line(tmp_path):
    """Logging unconfigured: the warning alone, pointing at the script's save line (a bare stderr
    line from logging's last resort came first, and the warning pointed into distckpt)."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "c")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "with_worker_rng" in line]
    assert len(said) == 1, done.stderr
    assert said[0].startswith(f"{script}:6: CheckpointWarning: state['loader'] loads with 2 workers"), said[0]

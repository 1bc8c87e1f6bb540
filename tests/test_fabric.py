"""Lightning Fabric (tests/fabric_loop.py under torchrun, 2 gloo ranks): the module and optimizer
fabric.setup returns in `state`, the StatefulDataLoader iterated itself, resumed bit for bit; the
loader wrapper fabric.setup_dataloaders returns refused in `state`, and iterated by the loop
refused at the resumed iter() (it resets the sampler's epoch to its own count)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOOP = os.path.join(HERE, "fabric_loop.py")


def _run(root, stop_after: int, log, workers: int, mode: str = "readme") -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5",
               LOOP, str(root), str(stop_after), str(log), str(workers), mode]
    return subprocess.run(command, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


def _logs(log) -> list[list[str]]:
    return [open(f"{log}.{rank}").read().splitlines() for rank in (0, 1)]


@pytest.mark.parametrize("workers, stop_after", [(0, 7), (2, 11)])  # mid-epoch; an epoch's last batch
def test_a_fabric_loop_with_batchnorm_resumes_bit_for_bit(tmp_path, workers, stop_after):
    """The module fabric.setup returns (_FabricModule over DDP) with BatchNorm: every save
    committed and no load passed the per-rank buffer check (its buffers were named through the
    wrapper, its state_dict through the inner module). Accumulation with no_backward_sync,
    OneCycleLR on the inner optimizer, augmentation from torch, Python and NumPy."""
    reference = _run(tmp_path / "ref", -1, tmp_path / "ref.log", workers)
    assert reference.returncode == 0, reference.stderr[-3000:]
    first = _run(tmp_path / "run", stop_after, tmp_path / "run.log", workers)
    assert first.returncode == 0, first.stderr[-3000:]
    relaunch = _run(tmp_path / "run", -1, tmp_path / "run.log", workers)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    for ran, expected in zip(_logs(tmp_path / "run.log"), _logs(tmp_path / "ref.log")):
        assert ran[stop_after].startswith(f"{stop_after} ") and ran[stop_after + 1].startswith(f"{stop_after + 1} ")
        assert ran == expected and len(expected) == 18


def test_iterating_fabrics_loader_wrapper_is_refused_at_the_first_save(tmp_path):
    """The loop iterates fabric.setup_dataloaders' wrapper, `state` holds the StatefulDataLoader
    under it: the wrapper set the sampler's epoch to 0 in the resumed process and the run went on
    in epoch 0's order, silently, after a mid-epoch save and after an epoch-end save alike.
    Refused at the first save on every rank (before any checkpoint exists), naming the cause."""
    out = _run(tmp_path / "run", -1, tmp_path / "run.log", 0, "fabric-loader")
    assert out.returncode != 0
    assert out.stderr.count("is iterated through Lightning Fabric's loader wrapper") >= 2, out.stderr[-3000:]
    assert "Iterate the StatefulDataLoader itself" in out.stderr
    assert all(len(lines) == 4 for lines in _logs(tmp_path / "run.log"))  # steps 0-3, the save of step 3 refused
    root = tmp_path / "run"
    assert not root.exists() or not any(p.name.startswith("step-") for p in root.iterdir())


def test_fabrics_loader_wrapper_in_state_is_refused_naming_what_to_do(tmp_path):
    out = _run(tmp_path / "run", -1, tmp_path / "run.log", 0, "fabric-loader-in-state")
    assert out.returncode != 0
    assert "is Lightning Fabric's loader wrapper (fabric.setup_dataloaders)" in out.stderr, out.stderr[-3000:]
    assert "Iterate the torchdata StatefulDataLoader itself" in out.stderr

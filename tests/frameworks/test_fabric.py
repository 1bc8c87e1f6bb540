"""Lightning Fabric (tests/helpers/fabric_loop.py under torchrun, 2 gloo ranks, SIGKILL and a torchrun
restart): the module and optimizer fabric.setup returns in `state`, the loader of
distckpt.integrations.fabric iterated itself, resumed bit for bit; the loader wrapper
fabric.setup_dataloaders returns refused in `state`, and iterated by the loop refused at the first
save (it sets the sampler's epoch to its own count, which restarts at 0 in a resumed process)."""

from __future__ import annotations

import os

import pytest
from zoo import run_zoo_pair, torchrun

pytestmark = pytest.mark.slow
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # the helper scripts
LOOP = os.path.join(HERE, "fabric_loop.py")
STEPS = 30  # micro-batches: 6 a rank each epoch (48 items, batch 4, 2 ranks)

faults = pytest.mark.faults

CASES = [
    pytest.param(["--workers", "2"], "13", id="workers-accumulation"),  # 13: after the save at an epoch's last batch
    pytest.param(["--async", "--accum", "3"], "10", id="async-accumulation3", marks=faults),
    pytest.param(["--workers", "2", "--async", "--every", "1"], "8,21", id="workers-async-two-resumes", marks=faults),
]


@pytest.mark.parametrize("options,kill_at", CASES)
def test_a_fabric_loop_killed_and_resumed_is_bitwise_identical(tmp_path, options, kill_at):
    """BatchNorm (per-rank buffers through Fabric's module wrapper), dropout, OneCycleLR on the
    inner optimizer, accumulation with no_backward_sync, augmentation from torch, Python and NumPy
    in 0 or 2 workers; the process group started by make_fabric (Fabric's own did not come up
    again after a torchrun restart)."""
    result = run_zoo_pair(str(tmp_path), 2, options, kill_at, kill_rank=1, steps=STEPS, loop=LOOP)
    assert len(result.resumes) == len(kill_at.split(",")), result.resumes
    assert result.identical, result.first_difference
    assert result.lines == STEPS * 2


def _run(tmp_path, mode: str) -> tuple[int, str]:
    out = torchrun(2, ["--ckpt", str(tmp_path / "ckpt"), "--loss-log", str(tmp_path / "log"), "--steps", "8",
                       "--mode", mode], max_restarts=0, timeout=240, loop=LOOP)
    return out.returncode, out.stdout + out.stderr


def _logged(tmp_path) -> list[int]:
    return [sum(1 for line in open(tmp_path / "log" / f"rank-{rank}.txt")) for rank in (0, 1)]


@pytest.mark.faults  # make test-faults (make test: the wrapper in state refused)
def test_iterating_fabrics_loader_wrapper_is_refused_at_the_first_save(tmp_path):
    """The loop iterates fabric.setup_dataloaders' wrapper, `state` holds the StatefulDataLoader
    under it: the wrapper set the sampler's epoch to 0 in the resumed process and the run went on
    in epoch 0's order, silently. Refused at the first save on every rank, before any checkpoint."""
    code, said = _run(tmp_path, "fabric-loader")
    assert code != 0
    assert said.count("is iterated through Lightning Fabric's loader wrapper") >= 2, said[-3000:]
    assert "Iterate the StatefulDataLoader itself" in said
    assert _logged(tmp_path) == [4, 4]  # micro-batches 0-3, the save after the second optimizer step refused
    root = tmp_path / "ckpt"
    assert not root.exists() or not any(p.name.startswith("step-") for p in root.iterdir())


def test_fabrics_loader_wrapper_in_state_is_refused_naming_what_to_do(tmp_path):
    code, said = _run(tmp_path, "fabric-loader-in-state")
    assert code != 0
    assert "is Lightning Fabric's loader wrapper (fabric.setup_dataloaders)" in said, said[-3000:]
    assert "Iterate the torchdata StatefulDataLoader itself" in said

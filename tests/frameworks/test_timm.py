"""timm (tests/helpers/timm_loop.py under torchrun, 2 gloo ranks, SIGKILL and a torchrun restart): a loop
written as timm's train.py writes its own, checkpointed through distckpt.integrations.timm, resumes
bit for bit; timm's own prefetcher and a replicated timm scheduler are refused loudly."""

from __future__ import annotations

import os

import pytest
from zoo import run_zoo_pair, torchrun

pytestmark = pytest.mark.slow
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # the helper scripts
LOOP = os.path.join(HERE, "timm_loop.py")
STEPS = 20  # optimizer steps: 8 batches a rank each epoch (64 pictures, batch 4, 2 ranks)

faults = pytest.mark.faults

CASES = [
    # augmentation in this process (RandAugment, random erasing in the prefetcher), a batch held at each save
    pytest.param(["--workers", "0"], "13", id="prefetcher"),
    pytest.param(["--workers", "2", "--accum", "2", "--async"], "13", id="prefetcher-workers-accum-async",
                 marks=faults),
    # a save at an epoch's last batch (step 7), then another resume
    pytest.param(["--workers", "0", "--every", "4"], "9,17", id="prefetcher-two-resumes-epoch-end", marks=faults),
]


@pytest.mark.parametrize("options,kill_at", CASES)
def test_a_timm_loop_killed_and_resumed_is_bitwise_identical(tmp_path, options, kill_at):
    """Drop path, bf16 autocast, EMA, Mixup/CutMix, RandAugment, random erasing, workers,
    accumulation, a persistent-workers evaluation loader every epoch: timm's prefetcher held a batch
    at every save (a resume through it skipped that batch: 60 of 250 losses equal), its scheduler
    each rank's running loss (refused as a replicated value that differs)."""
    result = run_zoo_pair(str(tmp_path), 2, options, kill_at, kill_rank=1, steps=STEPS, loop=LOOP)
    assert len(result.resumes) == len(kill_at.split(",")), result.resumes
    assert result.identical, result.first_difference
    assert result.lines == STEPS * 2


def _run(tmp_path, *options: str) -> tuple[int, str]:
    out = torchrun(2, ["--ckpt", str(tmp_path / "ckpt"), "--loss-log", str(tmp_path / "log"), "--steps", "6",
                       *options], max_restarts=0, timeout=300, loop=LOOP)
    return out.returncode, out.stdout + out.stderr


def test_timms_own_prefetcher_over_the_loader_in_state_is_refused_at_the_first_save(tmp_path):
    code, said = _run(tmp_path, "--timm-prefetcher")
    assert code != 0
    assert said.count("state['loader'] is iterated by timm's PrefetchLoader") >= 2, said[-3000:]
    assert "distckpt.integrations.timm.create_loader" in said
    assert not (tmp_path / "ckpt").exists() or not any(p.name.startswith("step-") for p in (tmp_path / "ckpt").iterdir())


@pytest.mark.faults  # make test-faults (make test: the kill-and-resume loop and the prefetcher refusal)
def test_a_timm_scheduler_saved_replicated_is_refused_naming_its_metric(tmp_path):
    code, said = _run(tmp_path, "--replicated-scheduler")
    assert code != 0
    assert "state['scheduler'] differs on rank(s) [1] from rank 0's in state['scheduler'].metric" in said, said[-3000:]

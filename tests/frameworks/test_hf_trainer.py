"""The Hugging Face Trainer (tests/helpers/hf_trainer_loop.py under torchrun, 2 gloo ranks, SIGKILL and a
torchrun restart) checkpointed through distckpt.integrations.hf_trainer: every (rank, optimizer
step) logged loss and parameter sum of the killed-and-resumed run equals the uninterrupted run's."""

from __future__ import annotations

import os

import pytest
from zoo import run_zoo_pair

pytestmark = pytest.mark.slow
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # the helper scripts
LOOP = os.path.join(HERE, "hf_trainer_loop.py")
STEPS = 15  # optimizer steps: 3 an epoch (6 batches a rank, accumulation over 2)

faults = pytest.mark.faults

CASES = [
    # mid-epoch: the Trainer's prepared loader holds a batch, its counters and running loss restored
    pytest.param([], "9", id="mid-epoch", marks=faults),
    # at an epoch's last step: the Trainer starts the next epoch (its sampler counts its own epochs)
    pytest.param(["--workers", "2", "--async"], "7", id="epoch-end-workers-async"),
    pytest.param(["--every", "1", "--accum", "3"], "5,11", id="two-resumes-accum3", marks=faults),
    # persistent workers and evaluations: the Trainer kept one evaluation loader from evaluation to
    # evaluation, whose first pass after a resume drew a base seed the uninterrupted run did not
    pytest.param(["--workers", "2", "--persistent", "--eval-every", "2"], "5", id="persistent-workers-evaluations",
                 marks=faults),
    # persistent workers, resumed from a save at an epoch's end (3 optimizer steps an epoch): kept,
    # the training loader's workers carried their streams into the next epoch, started anew on resume
    pytest.param(["--workers", "2", "--persistent", "--every", "3"], "5", id="persistent-workers-epoch-end",
                 marks=faults),
]


@pytest.mark.parametrize("options,kill_at", CASES)
def test_a_hf_trainer_killed_and_resumed_is_bitwise_identical(tmp_path, options, kill_at):
    result = run_zoo_pair(str(tmp_path), 2, options, kill_at, kill_rank=1, steps=STEPS, loop=LOOP)
    assert len(result.resumes) == len(kill_at.split(",")), result.resumes
    assert result.identical, result.first_difference
    if "--eval-every" in options:  # every rank logs its steps and its evaluations (also one as training ends)
        assert result.lines > STEPS * 2
    else:
        assert result.lines == STEPS * 2

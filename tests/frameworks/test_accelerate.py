"""Hugging Face Accelerate (tests/helpers/accelerate_loop.py under torchrun, 2 gloo ranks, SIGKILL and a
torchrun restart): every (rank, micro-batch) line of the killed-and-resumed run equals the
uninterrupted run's; the faults of an Accelerate loop as users write it are refused loudly."""

from __future__ import annotations

import json
import os
import sys

import pytest
from zoo import run_zoo_pair, torchrun

from distckpt.tools import cli

pytestmark = pytest.mark.slow
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # the helper scripts
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOP = os.path.join(HERE, "accelerate_loop.py")
STEPS = 30  # micro-batches: 6 a rank each epoch (48 items, batch 4, 2 ranks), so five epochs

faults = pytest.mark.faults

# (loop options, kill micro-batches): saves every 2 optimizer steps; accumulation over 2 batches
CASES = [
    # The README's loader (kept out of prepare()), the prepared optimizer under an overlapped snapshot.
    pytest.param(["--loader", "stateful", "--async", "--overlap"], "13", id="stateful-loader-overlap", marks=faults),
    pytest.param(["--loader", "stateful", "--workers", "2"], "13", id="stateful-loader-workers", marks=faults),
    # The prepared loader in `state`, mid-epoch and at an epoch's last batch, sync and async.
    pytest.param(["--loader", "prepared"], "9", id="prepared-loader"),
    pytest.param(["--loader", "prepared", "--workers", "2", "--async"], "13", id="prepared-loader-workers-async",
                 marks=faults),
    pytest.param(["--loader", "prepared", "--async", "--overlap", "--accum", "3"], "19",
                 id="prepared-loader-overlap-accum3", marks=faults),
    pytest.param(["--loader", "prepared", "--every", "1"], "6,17", id="prepared-loader-two-resumes", marks=faults),
    pytest.param(["--loader", "prepared", "--workers", "2", "--every", "3"], "12,24",
                 id="prepared-loader-workers-epoch-ends", marks=faults),
]


@pytest.mark.parametrize("options,kill_at", CASES)
def test_an_accelerate_loop_killed_and_resumed_is_bitwise_identical(tmp_path, options, kill_at):
    """The prepared model, optimizer (AcceleratedOptimizer: under overlap_snapshot=True its save
    raised AttributeError, the wrapper having no step hooks of its own) and scheduler in `state`,
    accumulation through accelerator.accumulate, augmentation drawn from torch's stream in the
    main process or in workers; the loader kept out of prepare(), or prepared (refused before: it
    holds a batch ahead of the loop and counts its epochs itself)."""
    result = run_zoo_pair(str(tmp_path), 2, options, kill_at, kill_rank=1, steps=STEPS, loop=LOOP)
    assert len(result.resumes) == len(kill_at.split(",")), result.resumes
    assert result.identical, result.first_difference
    assert result.lines == STEPS * 2


def _run(tmp_path, *options: str) -> tuple[int, str]:
    out = torchrun(2, ["--ckpt", str(tmp_path / "ckpt"), "--loss-log", str(tmp_path / "log"), "--steps", "8",
                       *options], max_restarts=0, timeout=240, loop=LOOP)
    return out.returncode, out.stdout + out.stderr


def _no_checkpoint(root) -> bool:
    return not root.exists() or not any(p.name.startswith("step-") for p in root.iterdir())


@pytest.mark.faults  # make test-faults
def test_accelerate_without_cpu_true_on_a_cpu_host_is_refused_on_every_rank(tmp_path):
    """Accelerator() under torchrun on a host without GPUs counts one process: each rank trained
    its own copy alone while the manager saved rank 0's as every rank's. Refused at load_latest."""
    code, said = _run(tmp_path, "--no-cpu", "--loader", "stateful")
    assert code != 0
    assert said.count("which sees 1 process(es), and this job has a world of 2") >= 2, said[-3000:]
    assert "Accelerator(cpu=True)" in said and "make_accelerator()" in said
    assert _no_checkpoint(tmp_path / "ckpt")


def test_a_plain_prepared_loader_is_refused_naming_use_stateful_dataloader(tmp_path):
    code, said = _run(tmp_path, "--loader", "plain-prepared")
    assert code != 0
    assert "use_stateful_dataloader=True" in said, said[-3000:]
    assert _no_checkpoint(tmp_path / "ckpt")


def test_a_save_before_the_first_optimizer_step_says_where_saves_belong(tmp_path):
    """Hugging Face's no_trainer scripts check for a save on every micro-batch: with accumulation
    the first save is save(-1), which said only 'must be an int >= 0'."""
    code, said = _run(tmp_path, "--save-minus-one", "--loader", "stateful")
    assert code != 0
    assert "step=-1: must be an int >= 0" in said, said[-3000:]
    assert "Accelerate accumulates gradients over 2 batches here" in said
    assert "save after an optimizer step" in said and "accelerator.sync_gradients" in said


@pytest.mark.parametrize("loader", [pytest.param("stateful", marks=faults), pytest.param("prepared", marks=faults)])
def test_the_doctor_with_every_passes_an_accelerate_loop(tmp_path, capsys, monkeypatch, loader):
    """doctor --every fingerprints every optimizer step through a step hook: on the optimizer
    Accelerate prepared, its install raised AttributeError at load_latest."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5", LOOP,
               "--ckpt", "/unused", "--loss-log", str(tmp_path / "log"), "--steps", "16", "--loader", loader,
               "--async", "--overlap"]
    code = cli.main(["doctor", "--kill-at", "7", "--every", "1", "--json", "--workdir", str(tmp_path / "doctor"),
                     "--", *command])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["fingerprint_every"] == 1 and report.get("first_fingerprint_step") is None, report

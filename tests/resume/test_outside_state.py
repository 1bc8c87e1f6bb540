"""What a loop keeps outside `state` and a resume cannot continue: an evaluation loader with
persistent workers that draws its workers' base seed from torch's global stream at its first pass
(timm's train.py), and a wrapper holding a batch ahead of a loader in `state` (timm's
PrefetchLoader). Each is a real loop (tests/helpers/zoo_loop.py under torchrun, 2 ranks) run by
`distckpt doctor`: the fault is named as its cause, and the same loop without the fault passes
with no cause given."""

from __future__ import annotations

import json
import os
import sys

import pytest

from distckpt.tools import cli

slow = pytest.mark.slow
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # the helper scripts
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _doctor(tmp_path, capsys, *options: str) -> tuple[int, dict, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5",
               os.path.join(HERE, "zoo_loop.py"), "--ckpt", "/unused", "--loss-log", str(tmp_path / "log"),
               "--steps", "20", "--every", "5", *options]
    code = cli.main(["doctor", "--kill-at", "9", "--json", "--workdir", str(tmp_path / "doctor"), "--", *command])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


@pytest.mark.parametrize("own_generator", [False, True])
def test_the_job_is_told_at_the_first_save_after_such_a_loaders_first_pass(tmp_path, own_generator):
    """The warning the doctor's cause comes from: said once, and only for a loader seeded from
    torch's global stream (one with a generator of its own never draws from it)."""
    import warnings

    import torch
    from torch.utils.data import DataLoader

    import distckpt

    generator = torch.Generator().manual_seed(1) if own_generator else None
    evaluation = DataLoader(list(range(8)), batch_size=4, num_workers=2, persistent_workers=True, generator=generator)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.save(0, {"w": torch.zeros(2)})  # before its first pass: nothing drawn yet
        assert [list(b) for b in evaluation] and [list(b) for b in evaluation]  # two passes, one draw
        mgr.save(1, {"w": torch.zeros(2)})
        mgr.save(2, {"w": torch.zeros(2)})
    said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]
    if own_generator:
        assert said == [], said
    else:
        assert len(said) == 1, said
        assert said[0].startswith("a loader over list with persistent workers is not in `state` and drew its "
                                  "workers' base seed from torch's global stream at its first pass"), said
        assert "Put the loader in `state`" in said[0] and "generator=torch.Generator()" in said[0]


@slow
def test_an_evaluation_loader_with_persistent_workers_outside_state_is_named(tmp_path, capsys, monkeypatch):
    """Its first pass (step 4) drew a base seed; the run resumed from step 9 drew it again at its
    first evaluation (step 14), so torch's stream was a draw off from then on. The doctor blamed the LR scheduler
    or a random stream outside `state`; the job's saves now see the loader and say so."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report, _ = _doctor(tmp_path, capsys, "--eval-persistent", "global")
    assert code == 1 and report["first_step"] == 14, report
    assert report["first_pass_draws"] == ["rank 0: a loader over NoisyDataset with persistent workers",
                                          "rank 1: a loader over NoisyDataset with persistent workers"], report
    assert report["causes"][0].startswith("a loader outside `state` drew a base seed at its first pass after the "
                                          "resume"), report["causes"]
    assert "put it in `state`" in report["causes"][0]
    assert not any("scheduler" in c for c in report["causes"]), report["causes"]


@slow
@pytest.mark.faults  # make test-faults (make test: the evaluation loader left outside state)
def test_a_wrapper_holding_a_batch_ahead_of_the_loader_in_state_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report, _ = _doctor(tmp_path, capsys, "--prefetcher")
    assert code == 1 and report["first_step"] == 14, report
    assert any(c.startswith("the loader in `state` is at least 1 batch ahead in the resumed run") and
               "a prefetcher holds them" in c for c in report["causes"]), report["causes"]


@slow
@pytest.mark.faults
@pytest.mark.parametrize("options", [["--eval-persistent", "own-generator"], ["--prefetch", "--workers", "2"]],
                         ids=["evaluation-loader-own-generator", "held-batch-in-state"])
def test_the_same_loops_without_the_fault_pass_with_no_cause(tmp_path, capsys, monkeypatch, options):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report, _ = _doctor(tmp_path, capsys, *options)
    assert code == 0 and report["causes"] == [] and report["first_pass_draws"] == [], report

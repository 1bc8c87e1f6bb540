"""`distckpt doctor --resize M` on a real torchrun job (tests/helpers/elastic_loop.py, which calls
distckpt.doctor_record each step): killed at N ranks, resumed at M. An elastic job passes with
every sample of the interrupted epoch once; a job that restarts its epoch (reshard) fails,
naming the repeated samples."""

from __future__ import annotations

import json
import os
import sys

import pytest

from distckpt.tools import cli

pytestmark = pytest.mark.slow
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _doctor(tmp_path, capsys, monkeypatch, *options: str) -> tuple[int, dict]:
    monkeypatch.setenv("PYTHONPATH", ROOT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5",
               os.path.join(HERE, "elastic_loop.py"), "--ckpt", "/unused/the/doctor/overrides/it",
               "--records", str(tmp_path / "records"), "--items", "48", "--save-every", "3", *options]
    code = cli.main(["doctor", "--resize", "3", "--kill-at", "3", "--json", "--workdir", str(tmp_path / "doctor"),
                     "--", *command])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.faults  # make test-faults (the accounting is unit-tested in tests/unit/test_elastic_api.py)
def test_an_elastic_job_feeds_the_interrupted_epoch_exactly_once(tmp_path, capsys, monkeypatch):
    code, report = _doctor(tmp_path, capsys, monkeypatch)
    assert report["old_world"] == 2 and report["new_world"] == 3 and report["resumed_from"] == 3
    assert report["epoch"] == 0 and report["epoch_samples"] == 48
    assert report["missed"] == {} and sum(report["repeated"].values()) <= 2  # padding: 48 - 16 = 32 over 3
    assert report["next_epoch_complete"] and report["loss_before_equal"]
    assert report["loss_max_abs_diff"] is not None and report["exactly_once"] and code == 0, report


@pytest.mark.faults  # make test-faults: the failing side of the same check
def test_a_job_that_restarts_its_epoch_is_reported(tmp_path, capsys, monkeypatch):
    code, report = _doctor(tmp_path, capsys, monkeypatch, "--policy", "reshard")
    assert code == 1 and not report["exactly_once"]
    assert sum(report["repeated"].values()) >= 16, report  # the 16 samples taken before the save, again

"""`distckpt doctor` on real torchrun jobs: a loop that resumes exactly passes; deliberately
broken loops fail, naming the first step, the entry and the likely cause."""

from __future__ import annotations

import json
import os
import sys

import pytest

from distckpt.tools import cli

pytestmark = pytest.mark.slow
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # the helper scripts
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _command(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5",
            os.path.join(HERE, "zoo_loop.py"), "--ckpt", "/unused/the/doctor/overrides/it",
            "--loss-log", "LOG", "--steps", "20", "--every", "5", *options]


def _doctor(tmp_path, capsys, *options: str) -> tuple[int, dict]:
    os.environ.setdefault("PYTHONPATH", ROOT)
    command = [a.replace("LOG", str(tmp_path / "log")) for a in _command(*options)]
    code = cli.main(["doctor", "--kill-at", "9", "--json", "--workdir", str(tmp_path / "doctor"), "--", *command])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.faults  # make test-faults; make test runs the --every broken loop below (both need both runs)
def test_a_loop_that_resumes_exactly_passes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--workers", "2")
    assert report["resumed"] and report["common_steps"] == [4, 9, 14, 19], report
    assert code == 0 and report["identical"], report


@pytest.mark.faults  # make test: the same loop with --every below (it checks the same and more)
def test_an_uncaptured_random_stream_is_found_with_its_first_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--unsaved-random")
    assert code == 1 and report["first_step"] == 14, report
    entries = {d["entry"] for d in report["differences"]}
    assert {"model", "optimizer"} <= entries and "rng" not in entries
    assert any("a random stream outside `state`" in c for c in report["causes"])


@pytest.mark.faults
def test_steps_ends_both_runs_early_and_the_kill_defaults_to_the_first_commit(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    command = [a.replace("LOG", str(tmp_path / "log")) for a in _command()]
    code = cli.main(["doctor", "--steps", "9", "--json", "--workdir", str(tmp_path / "doctor"), "--", *command])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["common_steps"] == [4, 9] and report["resumed"], report


@pytest.mark.faults
def test_workers_without_with_worker_rng_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--workers", "2", "--no-worker-rng")
    assert code == 1, report
    assert any("model" == d["entry"] for d in report["differences"])
    # named: the draws are in no checkpoint, so no difference of their own shows it
    assert any("`loader` worker streams differ" in c and "with_worker_rng" in c for c in report["causes"]), report


@pytest.mark.faults  # make test-faults; make test runs two broken loops: the random stream, and --every
def test_a_batch_drawn_before_the_save_and_kept_out_of_state_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--prefetch-unsaved")
    assert code == 1 and report["first_step"] == 14, report
    assert any(d["entry"] == "loader" for d in report["differences"]), report
    assert any("a batch drawn before the save" in c for c in report["causes"]), report["causes"]


@pytest.mark.faults
def test_a_model_left_in_eval_by_a_validation_pass_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--val-leaves-eval-at", "6")
    assert code == 1 and report["first_step"] == 14, report
    assert any("training flag" in c and "eval mode" in c for c in report["causes"]), report["causes"]
    assert report["per_step"]["9"] == [] and report["per_step"]["14"], report["per_step"]


@pytest.mark.faults  # make test-faults (26 s of torchrun; the per-step report above runs in make test)
def test_every_k_locates_the_first_differing_optimizer_step_between_checkpoints(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    command = [a.replace("LOG", str(tmp_path / "log")) for a in _command("--unsaved-random")]
    code = cli.main(["doctor", "--kill-at", "9", "--every", "1", "--json", "--workdir", str(tmp_path / "doctor"),
                     "--", *command])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["first_step"] == 14, report
    # Steps 0-9 are equal (the same hidden stream); the resumed run restarts it at step 10.
    assert report["fingerprint_every"] == 1 and report["first_fingerprint_step"] == 10, report
    assert "optimizer step 10" in report["causes"][0]


@pytest.mark.faults
def test_a_sampler_given_the_wrong_epoch_after_a_resume_is_named(tmp_path, capsys, monkeypatch):
    # 8 steps per epoch: the resumed run (from step 9, epoch 1) calls set_epoch(1) again at step 16.
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--forget-epoch")
    assert code == 1 and report["first_step"] == 19, report
    assert any(d["entry"] == "sampler" and d["path"].endswith("epoch") for d in report["differences"])
    assert any("set_epoch" in c for c in report["causes"]), report["causes"]


@pytest.mark.faults
def test_a_loop_that_never_calls_set_epoch_still_resumes_exactly(tmp_path, capsys, monkeypatch):
    # The sampler's epoch travels in `state`: never setting it is the same in both runs.
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--no-set-epoch")
    assert code == 0 and report["identical"], report


@pytest.mark.faults
def test_launch_train_py_resumes_exactly_under_the_doctor(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
               os.path.join(ROOT, "launch", "train.py"), "--ckpt", "/unused", "--loss-log", str(tmp_path / "log"),
               "--steps", "35", "--ckpt-every", "10", "--workers", "2"]
    code = cli.main(["doctor", "--kill-at", "10", "--every", "5", "--json", "--workdir", str(tmp_path / "doctor"),
                     "--", *command])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["common_steps"] == [10, 20, 30] and report["first_fingerprint_step"] is None, report


@pytest.mark.faults
def test_a_two_tier_job_is_compared_on_its_local_tier_too(tmp_path, capsys, monkeypatch):
    # Saves every 5 steps; every 2nd is durable (zoo_loop --local-tier): the doctor's roots get
    # <root>-local as local_dir, and every step both runs committed there is compared.
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, report = _doctor(tmp_path, capsys, "--local-tier")
    assert code == 0 and report["identical"] and report["common_steps"] == [4, 9, 14, 19], report
    assert os.path.isdir(tmp_path / "doctor" / "killed-local")


def test_a_kill_rank_outside_the_job_is_refused_after_the_first_run(tmp_path, capsys, monkeypatch):
    """--kill-rank was taken modulo the world size (5 in a world of 1 killed rank 0): a rank the
    job does not have is refused, naming the job's ranks, and nothing is killed."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    command = [a.replace("LOG", str(tmp_path / "log")) for a in _command()]
    code = cli.main(["doctor", "--steps", "4", "--kill-rank", "2", "--json", "--workdir", str(tmp_path / "doctor"),
                     "--", *command])
    report = json.loads(capsys.readouterr().out)
    assert code == 2, report
    assert "--kill-rank 2: the job has 2 rank(s), 0 to 1" in report["error"], report
    assert not (tmp_path / "doctor" / "killed").exists()


def test_a_run_that_hangs_is_killed_with_its_children_at_the_timeout(tmp_path, capsys):
    """A job hung at its exit (its loader workers never ending) held the doctor silently for its
    whole hour; each run is now bounded by --timeout, killed with every process of its session,
    and the error names the run."""
    import subprocess
    import time

    marker = f"{time.time_ns() % 10**6 + 600}"  # a sleep only this test starts
    command = ["bash", "-c", f"sleep {marker} & wait"]
    started = time.monotonic()
    code = cli.main(["doctor", "--timeout", "3", "--json", "--workdir", str(tmp_path / "doctor"), "--", *command])
    report = json.loads(capsys.readouterr().out)
    assert code == 2 and "the uninterrupted run did not end within 3s" in report["error"], report
    assert time.monotonic() - started < 30
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout.split()
    assert left == [], left



@pytest.mark.parametrize("resumed, common, first, killed_after, fingerprint, code", [
    (False, [4, 9], None, None, None, 2),  # the kill step never reached: nothing proven, not "they differ"
    (True, [], None, 4, None, 2),          # no step committed by both runs
    (True, [4, 9], None, 4, None, 0),
    (True, [4, 9], 9, 4, None, 1),
    # a script saving once, before the kill: the one common step was written before it, so the
    # resume was never compared (this passed, exit 0)
    (True, [4], None, 4, None, 2),
    # the same with --every: the fingerprints differ after the resume (this passed, exit 0)
    (True, [4], None, 4, 5, 1),
    (True, [4, 9], None, 4, 7, 1),
])
def test_the_doctors_exit_status_says_differ_only_when_they_differ(monkeypatch, capsys, resumed, common, first,
                                                                   killed_after, fingerprint, code):
    from distckpt.tools import doctor
    report = doctor.Report(common, [], [], first, resumed=resumed, killed_after=killed_after,
                           fingerprint_every=1 if fingerprint else None, first_fingerprint_step=fingerprint,
                           fingerprints_taken=bool(fingerprint))
    monkeypatch.setattr(doctor, "run_doctor", lambda *a, **k: report)
    assert cli.main(["doctor", "--json", "--", "true"]) == code
    data = json.loads(capsys.readouterr().out)
    assert data["resumed"] is resumed and data["identical"] is (code == 0)
    assert cli.main(["doctor", "--", "true"]) == code
    text = capsys.readouterr().out
    if common == [4] and fingerprint is None:
        assert "no step committed by both runs after the kill (after step 4)" in text and "not proven" in text, text
    if fingerprint is not None and first is None:
        assert f"VERDICT: differs — the parameters first differ after optimizer step {fingerprint}" in text, text


def test_a_failed_runs_error_keeps_its_header_and_what_it_raised_above_a_long_tail(tmp_path, capsys):
    """The report kept the last 3,000 characters only: which run failed, and the exception a long
    traceback followed, were cut off ("distckpt doctor: 0]:      ^^^^^")."""
    script = ("import sys; print('ValueError: the batch size 0 is not allowed', file=sys.stderr); "
              "print('x' * 120 + '\\n', end='', file=sys.stderr) if False else None; "
              "[print('filler line ' + str(i), file=sys.stderr) for i in range(2000)]; sys.exit(3)")
    code = cli.main(["doctor", "--json", "--workdir", str(tmp_path / "doctor"), "--", sys.executable, "-c", script])
    error = json.loads(capsys.readouterr().out)["error"]
    assert code == 2
    assert error.startswith("the uninterrupted run exited 3"), error[:300]
    assert "raised: ValueError: the batch size 0 is not allowed" in error, error[:600]
    assert "filler line 1999" in error  # and the tail is still there


@pytest.mark.parametrize("only_uninterrupted, only_killed, code", [
    ([], [19], 1),    # the resumed loop trained past where the uninterrupted one stopped
    ([19], [], 1),    # the resumed loop ended early
    ([2], [], 0),     # before the kill: written by the first attempt, nothing to do with the resume
])
def test_steps_only_one_run_committed_after_the_kill_are_a_difference(monkeypatch, capsys, only_uninterrupted,
                                                                     only_killed, code):
    """"Every common step equal" alone said bitwise identical (exit 0) while the resumed loop ran
    other steps than the uninterrupted one."""
    from distckpt.tools import doctor
    report = doctor.Report([4, 9, 14], only_uninterrupted, only_killed, None, resumed=True, killed_after=4)
    monkeypatch.setattr(doctor, "run_doctor", lambda *a, **k: report)
    assert cli.main(["doctor", "--", "true"]) == code
    text = capsys.readouterr().out
    if code == 1:
        assert "VERDICT: differs — the runs committed different steps after the kill" in text, text
    else:
        assert "VERDICT: bitwise identical" in text, text


def test_a_workdir_holding_an_earlier_run_is_refused_before_anything_runs(tmp_path, capsys):
    """Both runs resumed from the earlier run's roots and nothing was killed: a script whose resume
    is not exact was reported bitwise identical."""
    used = tmp_path / "doctor"
    (used / "uninterrupted").mkdir(parents=True)
    marker = tmp_path / "ran"
    code = cli.main(["doctor", "--workdir", str(used), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert code == 2 and not marker.exists()
    assert "the folder is not empty" in capsys.readouterr().err


def test_the_likely_cause_names_a_plain_value_a_missing_optimizer_a_scheduler_and_a_script_that_differs_unkilled():
    """Each said "a random stream outside `state`": a loop counter 15 vs 5, no optimizer to hook,
    the scheduler's own state differing, and runs that differed before the kill at all."""
    from distckpt.tools.doctor import Difference, Report, likely_causes

    counter = Difference(14, "replicated", "counter", "state", "15 uninterrupted, 5 resumed", "value")
    weights = Difference(14, "replicated", "model", "state/state_dict/0.weight", "128 of 128 elements differ, max |diff| 0.1",
                         "module")
    sched = Difference(14, "replicated", "scheduler", "state/_last_lr/0", "0.1 uninterrupted, 0.2 resumed", "stateful")
    after = Report([4, 9, 14], [], [], 14, resumed=True, killed_after=4)
    causes = likely_causes([counter, weights], after)
    assert "a plain value in `state` differs (`counter`: 15 uninterrupted, 5 resumed)" in causes[0], causes
    assert not any("random stream outside" in c for c in causes), causes
    unhooked = Report([4, 9, 14], [], [], 14, resumed=True, killed_after=4, fingerprint_every=1)
    assert any(c.startswith("no torch.optim optimizer in `state`") for c in likely_causes([weights], unhooked))
    scheduled = Report([4, 9, 14], [], [], 14, resumed=True, killed_after=4, entry_traits={"scheduler": ["lr_schedule"]})
    assert any(c.startswith("the LR scheduler's state differs") for c in likely_causes([sched, weights], scheduled))
    before = Report([4, 9, 14], [], [], 4, resumed=True, killed_after=9)
    assert likely_causes([weights], before)[0].startswith("the runs already differ at step 4, which both wrote before")
    assert "random stream outside `state`" in likely_causes([weights], after)[0]  # still the cause when nothing else is


def test_a_failed_runs_raised_line_names_the_ranks_exception_before_torchruns():
    from distckpt.tools.doctor import _failure

    stderr = ("Traceback (most recent call last):\n  File \"train.py\", line 3\n"
              "[rank1]: ValueError: boom on rank 1\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    text = str(_failure("the uninterrupted run", "failed (exit 1)", "", stderr))
    raised = next(line for line in text.splitlines() if line.startswith("raised: "))
    assert raised == "raised: ValueError: boom on rank 1"
    alone = str(_failure("run", "failed", "", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"))
    assert "raised: torch.distributed.elastic.multiprocessing.errors.ChildFailedError:" in alone


def test_difference_rows_show_a_long_parameter_path_whole():
    from distckpt.tools.doctor import Difference, Report, report_text

    path = "state/state_dict/_fsdp_wrapped_module.layers.11.attention.in_proj.weight"
    report = Report(common_steps=[4], only_uninterrupted=[], only_killed=[], first_step=4,
                    differences=[Difference(4, "rank 0", "model", path, "3 of 9 elements differ")])
    assert path in report_text(report)


def test_worker_streams_that_differ_in_a_wrapped_dataset_point_at_an_iterator_made_twice():
    """Worker streams are saved only for a dataset wrapped with with_worker_rng, so "wrap the
    dataset" was wrong advice (the PyTorch DDP tutorial's epoch-start peek, already wrapped)."""
    from distckpt.tools.doctor import Difference, Report, likely_causes

    streams = Difference(14, "rank 0", "loader", "state/worker_rng/0/torch", "5000 of 5056 elements differ", "loader")
    causes = likely_causes([streams], Report([9, 14], [], [], 14, resumed=True, killed_after=9))
    worker = next(c for c in causes if "worker streams differ" in c)
    assert "iterator made twice" in worker and "wrap the dataset" not in worker, worker

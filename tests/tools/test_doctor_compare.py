"""The doctor's comparison of two runs' checkpoints, on roots written by real managers: a process
stream that neither run seeds nor draws from differs between the runs from the start and is left
out (named in the report), so it neither raises a false alarm nor hides a real difference; a stream
that is drawn from is compared as before."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import distckpt
from distckpt.tools.doctor import compare_roots, report_text


def _run(root, entropy: int, draw_python: bool, model_bump_at: int | None) -> None:
    random.seed(entropy)  # what an unseeded process gets from the OS: different in every run
    np.random.seed(entropy)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with distckpt.CheckpointManager(str(root)) as mgr:
        for step in range(4):
            with torch.no_grad():
                model.weight.add_(torch.randn(2, 3))
                if step == model_bump_at:
                    model.weight[0, 0] += 1
            if draw_python:
                random.random()
            mgr.save(step, {"model": model})


@pytest.mark.parametrize("bump", [None, 2])
def test_streams_never_seeded_and_never_drawn_are_left_out_and_named(tmp_path, bump):
    _run(tmp_path / "a", 1, False, None)
    _run(tmp_path / "b", 2, False, bump)
    report = compare_roots(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.unused_streams == ["rank 0: rng/numpy", "rank 0: rng/python"], report
    assert report.first_step == bump, report
    if bump is not None:
        assert {d.entry for d in report.differences} == {"model"}, report.differences
    assert "left out: rank 0: rng/numpy, rank 0: rng/python" in report_text(report)


def test_an_unseeded_stream_that_is_drawn_from_is_a_difference(tmp_path):
    _run(tmp_path / "a", 1, True, None)
    _run(tmp_path / "b", 2, True, None)
    report = compare_roots(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.unused_streams == ["rank 0: rng/numpy"], report
    assert report.first_step == 0 and {(d.entry, d.path.split("/")[0]) for d in report.differences} == {("rng", "python")}


def test_identical_runs_leave_nothing_out(tmp_path):
    _run(tmp_path / "a", 1, True, None)
    _run(tmp_path / "b", 1, True, None)
    report = compare_roots(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.unused_streams == [] and report.first_step is None and report.common_steps == [0, 1, 2, 3]


@pytest.mark.faults  # a doctor run of its own (make test-faults)
def test_every_k_without_an_optimizer_says_no_fingerprints_were_taken(tmp_path):
    """A loop stepping its parameters by hand gives --every nothing to hook: said so, never
    'equal at every common step'."""
    from distckpt.tools.doctor import run_doctor

    script = tmp_path / "manual_sgd.py"
    script.write_text(
        "import torch, distckpt\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(3, 1)\n"
        "with distckpt.CheckpointManager('/unused') as mgr:\n"
        "    p = mgr.load_latest({'model': m})\n"
        "    for step in range(p.step + 1 if p else 0, 4):\n"
        "        m(torch.randn(4, 3)).sum().backward()\n"
        "        with torch.no_grad():\n"
        "            for q in m.parameters():\n"
        "                q -= 0.1 * q.grad\n"
        "                q.grad = None\n"
        "        mgr.save(step, {'model': m})\n")
    import sys

    report = run_doctor([sys.executable, str(script)], kill_at=1, workdir=str(tmp_path / "wd"), every=1)
    assert report.fingerprint_every == 1 and not report.fingerprints_taken
    text = report_text(report)
    assert "none taken" in text and "equal at every common step" not in text


def test_a_difference_in_a_tensor_that_requires_grad_is_described_without_a_warning():
    import warnings

    from distckpt.tools.doctor import _describe

    a, b = torch.zeros(3, requires_grad=True), torch.ones(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _describe(a * 1.0, b * 1.0) == "3 of 3 elements differ, max |diff| 1"


def test_a_learning_rate_difference_points_at_the_scheduler():
    """A scheduler left out of `state`: the optimizer's lr differs after the resume, and the cause
    given was a random stream outside `state`, which sent the user the wrong way."""
    from distckpt.tools.doctor import Difference, Report, likely_causes

    diffs = [Difference(14, "replicated", "optimizer", "state/param_groups/0/lr", "0.000625 uninterrupted, 0.00166 resumed",
                        "stateful"),
             Difference(14, "replicated", "model", "state_dict/0.weight", "12 of 12 elements differ", "module")]
    traits = {"optimizer": ["optimizer"], "model": ["weights"], "scheduler": ["lr_schedule"]}
    causes = likely_causes(diffs, Report([4, 9, 14], [], [], 14, entry_traits=traits))
    assert "LR scheduler in `state`" in causes[0], causes
    with_scheduler = diffs + [Difference(14, "replicated", "scheduler", "state/last_epoch", "13 uninterrupted, 12 resumed",
                                         "stateful")]
    causes = likely_causes(with_scheduler, Report([14], [], [], 14, entry_traits=traits))
    assert not any("LR scheduler in `state`" in c for c in causes), causes
    assert any(c.startswith("the LR scheduler's state differs") for c in causes), causes


_SCRIPT = (
    "import random, sys, torch, distckpt\n"
    "torch.manual_seed(0)\n"
    "noise = random.Random()  # seeded from the clock: outside `state` unless asked to differ\n"
    "m = torch.nn.Linear(3, 1)\n"
    "with distckpt.CheckpointManager('/unused') as mgr:\n"
    "    p = mgr.load_latest({'model': m})\n"
    "    for step in range(p.step + 1 if p else 0, 4):\n"
    "        with torch.no_grad():\n"
    "            m.weight += noise.random() if 'differ' in sys.argv else 0.5\n"
    "        mgr.save(step, {'model': m})\n")


def _doctor_folders(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("distckpt-doctor-"))


@pytest.mark.parametrize("how", ["identical", pytest.param("differ", marks=pytest.mark.faults), "fails"])
def test_the_doctors_own_work_folder_is_removed_when_identical_and_named_when_kept(tmp_path, monkeypatch, capsys, how):
    """Each doctor run left a temporary folder of both runs' roots behind (~1 MB), its path said
    nowhere but in some errors: now an identical verdict removes it, and a difference or a failed
    run keeps it and names it (that is where a look into what differs starts)."""
    import sys
    import tempfile

    from distckpt.tools import cli
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT if how != "fails" else "raise SystemExit('ValueError: no data')\n")
    code = cli.main(["doctor", "--kill-at", "1", "--", sys.executable, str(script), how])
    out = capsys.readouterr()
    folders = _doctor_folders(tmp_path)
    if how == "identical":
        assert code == 0 and folders == [] and "kept" not in out.out, out
        return
    assert code == (1 if how == "differ" else 2) and len(folders) == 1, (code, folders, out)
    kept = str(tmp_path / folders[0])
    said = out.out if how == "differ" else out.err
    assert kept in said, said[-800:]
    if how == "differ":
        assert f"both runs' roots are kept: {kept}/uninterrupted and {kept}/killed" in said
        assert (tmp_path / folders[0] / "killed").is_dir()


def _loader_run(root, entropy: int, sampler_draws_numpy: bool) -> None:
    """A loader whose epochs start with a record of the global streams (the sampler replay):
    with NumPy never seeded, each run's record holds another NumPy state."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    random.seed(entropy)
    np.random.seed(entropy)
    torch.manual_seed(0)

    class NumpyShuffle(torch.utils.data.Sampler):
        def __len__(self) -> int:
            return 32

        def __iter__(self):
            order = np.random.permutation(32) if sampler_draws_numpy else range(32)
            return iter(int(i) for i in order)

    sampler: torch.utils.data.Sampler = (NumpyShuffle() if sampler_draws_numpy else
                                         torch.utils.data.RandomSampler(range(32), generator=torch.Generator().manual_seed(3)))
    loader = StatefulDataLoader(list(range(32)), batch_size=4, sampler=sampler)
    model = torch.nn.Linear(3, 2)
    with distckpt.CheckpointManager(str(root)) as mgr:
        assert mgr.load_latest({"model": model, "loader": loader}) is None
        step = 0
        for _ in range(2):
            for batch in loader:
                with torch.no_grad():
                    model.weight.add_(batch.float().sum())
                if step % 3 == 2:
                    mgr.save(step, {"model": model, "loader": loader})
                step += 1


def test_the_loaders_record_of_a_stream_never_seeded_and_never_drawn_is_left_out(tmp_path):
    """The sampler replay records the global streams at each epoch's start: a NumPy stream no run
    seeds or draws from differs in that record too, and is left out there as well (it made the
    doctor call every step different, steps before the kill included)."""
    _loader_run(tmp_path / "a", 1, False)
    _loader_run(tmp_path / "b", 2, False)
    report = compare_roots(str(tmp_path / "a"), str(tmp_path / "b"))
    assert "rank 0: rng/numpy" in report.unused_streams, report
    assert report.first_step is None, report.differences
    assert len(report.common_steps) == 5


def test_a_stream_the_sampler_draws_from_still_differs_in_the_loaders_record(tmp_path):
    _loader_run(tmp_path / "a", 1, True)
    _loader_run(tmp_path / "b", 2, True)
    report = compare_roots(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.first_step is not None, report
    assert "rank 0: rng/numpy" not in report.unused_streams


def test_a_model_difference_with_every_stream_equal_names_values_carried_outside_state():
    """An RNN's hidden state or an enumerate index kept outside `state` makes only the model differ;
    the cause named it only as a random stream or a prefetched batch."""
    from distckpt.tools.doctor import Difference, Report, likely_causes

    report = Report([5, 10], [], [], 10, killed_after=5, resumed=True)
    causes = likely_causes([Difference(10, "replicated", "model", "state_dict/w", "3 of 9 elements differ")], report)
    assert any("hidden state" in c and "enumerate(loader)'s index" in c for c in causes), causes


def test_a_kill_step_the_job_never_commits_is_said_to_be_one():
    """--kill-at on a step the job does not save never kills: the report said the run 'never
    reached' a step it had passed."""
    from distckpt.tools.doctor import Report

    text = report_text(Report([4, 9], [], [], None, resumed=False))
    assert "committed no such step" in text and "--kill-at" in text and "never reached" not in text


def test_a_position_the_loop_keeps_itself_is_said_as_such_not_as_prefetching():
    """llm.c's DistributedDataLoader position kept in a per_rank dict and never applied back after
    the load: the cause given was prefetching or a peek at an epoch's start."""
    from distckpt.tools.doctor import Difference, Report, likely_causes

    own = [Difference(14, "rank 0", "loader", "state/current_position", "2304 uninterrupted, 2560 resumed", "value")]
    causes = likely_causes(own, Report([4, 9, 14], [], [], 9))
    assert any("a value your loop keeps in `state['loader']`" in c and "not applied back" in c for c in causes), causes
    assert not any("prefetching" in c for c in causes), causes
    torchdata = [Difference(14, "rank 0", "loader", "state/_num_yielded", "3 uninterrupted, 4 resumed", "loader")]
    assert any("prefetching" in c for c in likely_causes(torchdata, Report([4, 9, 14], [], [], 9)))


def _momentum_run(root, resume_at: int | None, optimizer_in_state: bool) -> None:
    """SGD with momentum; at `resume_at` the optimizer is built anew, as a relaunch builds it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with distckpt.CheckpointManager(str(root)) as mgr:
        for step in range(6):
            if step == resume_at:
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                if optimizer_in_state:
                    mgr.load({"model": model, "optimizer": opt}, step=step - 1)
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model, "optimizer": opt} if optimizer_in_state else {"model": model})


def test_a_model_that_differs_with_no_optimizer_in_state_names_the_optimizer(tmp_path):
    # The cause given was a random stream outside `state`, with every stream equal and the
    # optimizer simply left out (momentum started over at the resume).
    _momentum_run(tmp_path / "a", None, False)
    _momentum_run(tmp_path / "b", 3, False)
    report = compare_roots(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.first_step == 3 and report.entry_kinds == {"model": "module"}, report
    assert any("no torch.optim optimizer in `state`" in c for c in report.causes), report.causes
    assert not any("random stream outside" in c for c in report.causes), report.causes


def test_a_model_that_differs_with_its_optimizer_in_state_is_not_blamed_on_a_missing_optimizer(tmp_path):
    _momentum_run(tmp_path / "a", None, True)
    _momentum_run(tmp_path / "b", 3, True)
    assert compare_roots(str(tmp_path / "a"), str(tmp_path / "b")).first_step is None  # resumed exactly
    torch.manual_seed(0)
    model, bumped = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with torch.no_grad():
        bumped.weight.copy_(model.weight)
        bumped.bias.copy_(model.bias + 1)
    for root, m in (("c", model), ("d", bumped)):
        with distckpt.CheckpointManager(str(tmp_path / root)) as mgr:
            mgr.save(0, {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1)})
    report = compare_roots(str(tmp_path / "c"), str(tmp_path / "d"))
    assert report.entry_kinds == {"model": "module", "optimizer": "optimizer"}, report.entry_kinds
    assert not any("no torch.optim optimizer" in c for c in report.causes), report.causes


@pytest.mark.parametrize("loader_in_state", [False, True])
def test_a_sampler_epoch_difference_without_a_loader_in_state_names_the_loader(loader_in_state):
    # The loop called set_epoch at every epoch start; the loader was left out, so the resume
    # started the epoch over and the steps fell in other epochs. The cause said to call set_epoch.
    from distckpt.tools.doctor import Difference, Report, likely_causes

    traits = {"model": ["weights"], "sampler": ["sampling_order"], **({"loader": ["data_position"]} if loader_in_state else {})}
    report = Report([2, 5, 8], [], [], 8, killed_after=5, resumed=True, entry_traits=traits)
    causes = likely_causes([Difference(8, "rank 0", "sampler", "state/epoch", "1 uninterrupted, 0 resumed", "sampler")], report)
    assert any("no data loader is in `state`" in c for c in causes) is not loader_in_state, causes
    assert any("call sampler.set_epoch" in c for c in causes) is loader_in_state, causes


# -- causes keyed by kind, not by the keys users choose ---------------------------------------------

# A loop whose DataLoader is left out of `state`: a resume takes the pass's batches from its start
# again. The keys of `state` come from the command line (the usual ones, or unusual ones).
_LOADER_LEFT_OUT = (
    "import sys, torch, distckpt\n"
    "model_key, optimizer_key = sys.argv[1:3]\n"
    "torch.manual_seed(0)\n"
    "data = torch.arange(48.0).reshape(24, 2)\n"
    "loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))\n"
    "model = torch.nn.Linear(2, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
    "state = {model_key: model, optimizer_key: opt}\n"
    "with distckpt.CheckpointManager('/unused') as mgr:\n"
    "    p = mgr.load_latest(state)\n"
    "    step = p.step + 1 if p else 0\n"
    "    while step < 10:\n"
    "        for batch in loader:\n"
    "            model(batch).sum().backward()\n"
    "            opt.step()\n"
    "            opt.zero_grad()\n"
    "            if step % 2 == 1:\n"
    "                mgr.save(step, state)\n"
    "            step += 1\n"
    "            if step == 10:\n"
    "                break\n")


@pytest.mark.parametrize("names", [("model", "optimizer"), pytest.param(("net", "opt"), marks=pytest.mark.faults)])
def test_a_loader_left_out_of_state_is_the_doctors_cause(tmp_path, capsys, names):
    """The job's own saves warned that no loader in `state` iterated the data; the doctor's cause
    was the generic 'a random stream outside `state`'. It names the loader now, whatever the
    entries are called."""
    import json
    import sys

    from distckpt.tools import cli

    script = tmp_path / "loop.py"
    script.write_text(_LOADER_LEFT_OUT)
    code = cli.main(["doctor", "--kill-at", "3", "--json", "--workdir", str(tmp_path / "wd"), "--",
                     sys.executable, str(script), *names])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["first_step"] == 5, report
    assert not any("random stream outside" in c for c in report["causes"]), report["causes"]
    cause = next((c for c in report["causes"] if "holds no loader" in c), None)
    assert cause is not None and "a loader over Tensor at batch 2 of 6" in cause, report["causes"]
    assert "put the DataLoader in `state`" in cause and "StatefulDataLoader" in cause
    # the first two saves of each run look (steps 1 and 3; 5 and 7 after the resume at step 4)
    assert report["loaders_left_out"] == ["rank 0: a loader over Tensor at batch 2 of 6",
                                          "rank 0: a loader over Tensor at batch 4 of 6"], report["loaders_left_out"]


_USUAL = {"model": "model", "optimizer": "optimizer", "scheduler": "scheduler", "loader": "loader"}
_UNUSUAL = {"model": "net", "optimizer": "opt", "scheduler": "lr", "loader": "batches"}


def _named_run(root, names: dict[str, str], resume_at: int | None, fault: str) -> None:
    """Six steps saving every step; at `resume_at` every object is built anew and loaded from the
    step before, as a relaunch does, with `fault` the way the loop gets the resume wrong."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        loader = StatefulDataLoader(torch.arange(48.0).reshape(24, 2), batch_size=2, shuffle=True,
                                    generator=torch.Generator().manual_seed(2))
        return model, opt, sched, loader

    model, opt, sched, loader = build()
    position = {"pos": 0}  # a position the loop keeps itself (fault "position"): in place of the loader
    state = {names["model"]: model, names["optimizer"]: opt, names["scheduler"]: sched,
             names["loader"]: distckpt.per_rank(position) if fault == "position" else loader}
    batches = iter(loader)
    with distckpt.CheckpointManager(str(root)) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore", distckpt.DistCkptWarning)
        for step in range(6):
            if step == resume_at:
                model, opt, sched, loader = build()
                state = {names["model"]: model, names["optimizer"]: opt, names["scheduler"]: sched,
                         names["loader"]: state[names["loader"]] if fault == "position" else loader}
                mgr.load({k: v for k, v in state.items() if not (fault == "scheduler" and k == names["scheduler"])},
                         step=step - 1)
                if fault == "peek":
                    next(iter(loader))  # a peek at the resumed pass takes its position
                batches = iter(loader)
                if fault == "position":
                    pos = 0  # the loop's own count, never read back from `state`
            pos = step if fault != "position" or resume_at is None or step < resume_at else pos + 1
            position["pos"] = pos
            model(next(batches)).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            mgr.save(step, state)


def _causes(tmp_path, names: dict[str, str], fault: str) -> list[str]:
    _named_run(tmp_path / f"{fault}-{names['model']}-a", names, None, fault)
    _named_run(tmp_path / f"{fault}-{names['model']}-b", names, 3, fault)
    report = compare_roots(str(tmp_path / f"{fault}-{names['model']}-a"), str(tmp_path / f"{fault}-{names['model']}-b"))
    assert report.first_step == 3, (fault, report)
    return report.causes


@pytest.mark.parametrize("fault, cause", [
    ("scheduler", "the LR scheduler's state differs"),
    ("peek", "the loader's position differs"),
    ("position", "a value your loop keeps in `state['loader']` differs"),
])
def test_entries_under_unusual_keys_get_the_causes_the_usual_keys_get(tmp_path, fault, cause):
    """The causes matched the keys users choose (a scheduler called `scheduler`, a loader `loader`):
    under `lr` or `batches` the same mistake got the generic cause. They follow the kinds now."""
    import re

    usual = _causes(tmp_path, _USUAL, fault)
    unusual = _causes(tmp_path, _UNUSUAL, fault)
    back = {new: old for old, new in zip(_USUAL.values(), _UNUSUAL.values())}
    renamed = [re.sub(r"(?<=['`])(\w+)(?=['`])", lambda m: back.get(m.group(1), m.group(1)), c) for c in unusual]
    assert renamed == usual, (usual, unusual)
    assert any(c.startswith(cause) for c in usual), usual
    assert not any("random stream outside" in c for c in usual), usual

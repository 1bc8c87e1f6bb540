"""The `distckpt` command line on local and S3 checkpoints, healthy and damaged."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import distckpt
from distckpt.tools import cli


def make_run(url: str, steps=(1, 2, 3)) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    sampler = torch.utils.data.DistributedSampler(list(range(10)), num_replicas=1, rank=0)
    with distckpt.CheckpointManager(url) as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(step)
            sampler.set_epoch(step)
            mgr.save(step, {"model": model, "sampler": sampler, "config": {"lr": 0.1 * step}},
                     epoch=step, metric=1.0 / step)


def run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def damage(url: str, step: int, name: str) -> None:
    from distckpt.storage import open_storage

    s = open_storage(url)
    path = f"step-{step:09d}/{name}"
    data = bytearray(s.read_bytes(path))
    data[len(data) // 2] ^= 0x10
    s.write_file(path, [bytes(data)])


def test_ls_shows_committed_and_uncommitted(url, capsys):
    make_run(url)
    from distckpt.storage import open_storage

    open_storage(url).write_file("step-000000004/replicated/state.g000001.safetensors", [b"partial"])
    code, out = run(capsys, "ls", url, "--json")
    rows = json.loads(out)
    assert code == 0
    assert [(r["step"], r["status"]) for r in rows] == [(1, "committed"), (2, "committed"), (3, "committed"), (4, "uncommitted")]
    assert rows[2]["epoch"] == 3 and rows[2]["metric"] == pytest.approx(1 / 3) and rows[2]["bytes"] > 0
    code, out = run(capsys, "ls", url)
    assert "uncommitted" in out and "committed" in out


def test_inspect_shows_ranks_config_and_tensors(url, capsys):
    make_run(url)
    code, out = run(capsys, "inspect", url, "--json", "--step", "2")
    d = json.loads(out)
    assert code == 0 and d["manifest"]["step"] == 2 and d["config"] == {"lr": 0.2}
    rank = d["ranks"][0]
    assert rank["rng_streams"] == ["cuda", "numpy", "python", "torch_cpu"]
    assert rank["entries"]["sampler"]["epoch"] == 2 and rank["entries"]["sampler"]["type"] == "DistributedSampler"
    assert {t["name"] for t in d["tensors"]} >= {"replicated/entries/model/state/state_dict/weight"}
    code, out = run(capsys, "inspect", url)
    assert "step 3" in out and "RNG streams" in out and "weight" not in out  # one line per entry
    assert run(capsys, "inspect", url, "--tensors")[1].count("model/state_dict/weight") == 1


def test_verify_names_each_bad_file(url, capsys):
    make_run(url)
    assert run(capsys, "verify", url, "--all")[0] == 0
    damage(url, 2, "ranks/rank-00000.g000001.safetensors")
    code, out = run(capsys, "verify", url, "--all", "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    assert code == 1 and rows[1]["ok"] and rows[3]["ok"] and not rows[2]["ok"]
    assert "rank-00000.g000001.safetensors" in rows[2]["problems"][0] and "checksum" in rows[2]["problems"][0]
    from distckpt.storage import open_storage

    open_storage(url).remove_file("step-000000003/manifest.json")
    code, out = run(capsys, "verify", url, "--step", "3")
    assert code == 1 and "manifest.json" in out


def test_verify_reports_a_damaged_lease_and_what_it_fences(url, capsys):
    from distckpt.protocol.fencing import lease_generations, lease_path
    from distckpt.storage import open_storage

    make_run(url)
    storage = open_storage(url)
    code, out = run(capsys, "verify", url)
    assert code == 0 and "damaged lease" not in out
    generation = max(lease_generations(storage))
    storage.write_file(lease_path(generation), [b"{not json"])
    code, out = run(capsys, "verify", url)
    assert f"damaged lease: generation {generation}" in out and "resumed from nothing" in out, out


def test_prune_and_gc_with_dry_run(url, capsys):
    make_run(url, steps=(1, 2, 3, 4))
    from distckpt.storage import open_storage

    open_storage(url).write_file("step-000000009/ranks/rank-00000.g000001.safetensors", [b"partial"])
    code, out = run(capsys, "prune", url, "--keep-last", "1", "--keep-best", "1", "--best-mode", "max", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["removed"] == [2, 3]
    assert distckpt.CheckpointManager(url).committed_steps() == [4, 3, 2, 1]
    assert json.loads(run(capsys, "prune", url, "--keep-last", "1", "--keep-best", "1", "--best-mode", "max", "--json")[1])["removed"] == [2, 3]
    assert distckpt.CheckpointManager(url).committed_steps() == [4, 1]
    assert json.loads(run(capsys, "gc", url, "--json")[1])["removed"] == []  # too young
    assert json.loads(run(capsys, "gc", url, "--grace-s", "0", "--dry-run", "--json")[1])["removed"] == [9]
    assert json.loads(run(capsys, "gc", url, "--grace-s", "0", "--json")[1])["removed"] == [9]
    assert [r["step"] for r in json.loads(run(capsys, "ls", url, "--json")[1])] == [1, 4]


def _break(path: str, how: str) -> None:
    import os

    if how == "missing":
        os.remove(path)
    elif how == "garbage":
        open(path, "wb").write(b"garbage{")
    else:
        data = bytearray(open(path, "rb").read())
        if how == "truncated":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x10
        open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("which, how", [("COMMITTED", "garbage"), ("manifest.json", "missing"),
                                        ("replicated", "flipped"), ("rank", "truncated")])
@pytest.mark.parametrize("policy", [["--keep-last", "1"], ["--keep-last", "1", "--keep-best", "1", "--best-mode", "min"]])
def test_prune_never_counts_a_damaged_step_toward_what_it_keeps(tmp_path, capsys, which, how, policy):
    """A damaged newest step was counted as the kept one and every loadable step removed."""
    import glob

    url = str(tmp_path / "ckpt")
    make_run(url, steps=(1, 2, 3))
    pattern = {"replicated": "replicated/*", "rank": "ranks/rank-*"}.get(which, which)
    _break(glob.glob(f"{url}/step-000000003/{pattern}")[0], how)
    code, out = run(capsys, "prune", url, *policy, "--dry-run", "--json")
    planned = json.loads(out)
    assert code == 0 and planned["removed"] == [1] and list(planned["damaged"]) == ["3"]
    code, out = run(capsys, "prune", url, *policy, "--json")
    assert json.loads(out)["removed"] == planned["removed"]
    fresh = {"model": nn.Linear(3, 2), "sampler": torch.utils.data.DistributedSampler(list(range(10)), num_replicas=1, rank=0),
             "config": {}}
    with pytest.warns(distckpt.CheckpointFallbackWarning):
        assert distckpt.CheckpointManager(url).load_latest(fresh).step == 2
    assert run(capsys, "verify", url, "--step", "2")[0] == 0


def test_diff_reports_what_changed(url, capsys):
    make_run(url)
    code, out = run(capsys, "diff", url, "1", "3", "--json")
    rows = {r["key"]: r for r in json.loads(out)}
    weight = rows["replicated/state/entries/model/state/state_dict/weight"]
    assert code == 0 and weight["change"] == "values" and weight["max_abs_diff"] == pytest.approx(5.0)
    assert rows["replicated/state/entries/config/state/lr"]["new"] == pytest.approx(0.3)
    assert rows["ranks/rank-00000/epoch"] == {"key": "ranks/rank-00000/epoch", "change": "value", "old": 1, "new": 3}
    code, out = run(capsys, "diff", url, "1", "9", "--json")  # said as a step that is not committed
    assert code == 2 and "step 9 is not committed" in json.loads(out)["error"]


def test_diff_across_a_restart_pairs_the_files_by_their_role(tmp_path, capsys):
    """Steps of two incarnations: the file names differ by the writer's generation; every key
    came out as removed and added, and the one change was never shown."""
    url = str(tmp_path / "ckpt")
    make_run(url, steps=(1,))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    sampler = torch.utils.data.DistributedSampler(list(range(10)), num_replicas=1, rank=0)
    with distckpt.CheckpointManager(url) as mgr:
        mgr.load_latest({"model": model, "sampler": sampler, "config": {"lr": 0.1}})
        mgr.save(2, {"model": model, "sampler": sampler, "config": {"lr": 0.1}}, epoch=1, metric=1.0)
    code, out = run(capsys, "diff", url, "1", "2", "--json")
    changed = {r["key"]: r["change"] for r in json.loads(out)}
    assert code == 0 and "added" not in changed.values() and "removed" not in changed.values(), changed
    assert set(changed) == {"replicated/state/step", "ranks/rank-00000/step"}, changed


def test_errors_and_exit_codes(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["inspect", str(tmp_path / "empty")]) == 1  # a root with nothing to show
    assert cli.main(["verify", str(tmp_path / "empty")]) == 1
    make_run(str(tmp_path / "c"), steps=(1,))
    assert cli.main(["inspect", str(tmp_path / "c"), "--step", "5"]) == 2
    assert "step 5 is not committed at" in capsys.readouterr().err


def test_entry_point_runs(tmp_path):
    make_run(str(tmp_path / "c"), steps=(1,))
    out = subprocess.run([sys.executable, "-m", "distckpt", "ls", str(tmp_path / "c")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "committed" in out.stdout


@pytest.mark.parametrize("argv, needle", [
    (["--json"], "give the launch command"),
    (["--steps", "abc", "--json", "--", sys.executable, "-c", "pass"], "--steps"),
    (["--every", "0", "--json", "--", sys.executable, "-c", "pass"], "--every must be >= 1"),
    (["--kill-at", "-1", "--json", "--", sys.executable, "-c", "pass"], "--kill-at must be >= 0"),
    *[(["--timeout", v, "--json", "--", sys.executable, "-c", "pass"], "--timeout must be a positive number")
      for v in ("0", "-1", "nan", "inf")],
    (["--json", "--", "/nonexistent/launcher"], "No such file"),
])
def test_doctor_with_json_answers_every_error_as_one_json_document(capsys, argv, needle):
    with pytest.raises(SystemExit) if "/nonexistent/launcher" not in argv else contextlib.nullcontext() as raised:
        code = cli.main(["doctor", *argv])
    code = raised.value.code if raised is not None else code
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["command"] == "doctor" and out["exit_code"] == 2 and needle in out["error"], out


def test_the_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = capsys.readouterr().out
    for name in [*cli.COMMANDS, "doctor"]:
        assert name in listed, name


@pytest.mark.parametrize("command", [["ls"], ["inspect"], ["verify"], ["prune", "--keep-last", "1"], ["gc"],
                                     ["diff", "--", "1", "2"]])
def test_a_root_that_does_not_exist_is_an_error_with_the_documented_code(tmp_path, capsys, command):
    name, *rest = command
    args = [name, str(tmp_path / "nowhere"), *rest]
    assert cli.main(args) == 2
    assert "no such checkpoint root" in capsys.readouterr().err
    assert cli.main([*args, "--json"] if name != "diff" else [name, "--json", str(tmp_path / "nowhere"), "1", "2"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 2 and "no such checkpoint root" in out["error"]


def test_every_json_outcome_is_one_json_document(tmp_path, capsys):
    make_run(str(tmp_path / "c"), steps=(1,))
    for args, code in ((["inspect", str(tmp_path / "c"), "--step", "5", "--json"], 2),
                       (["verify", str(tmp_path / "c"), "--json"], 0),
                       (["prune", str(tmp_path / "c"), "--keep-last", "0", "--json"], 2),
                       (["ls", "--json", str(tmp_path / "c"), "--bogus"], 2)):
        with pytest.raises(SystemExit) if "--bogus" in args else contextlib.nullcontext() as ctx:
            assert cli.main(args) == code
        if ctx is not None and hasattr(ctx, "value"):
            assert ctx.value.code == code
        json.loads(capsys.readouterr().out)  # one document, errors included


def test_step_names_parse_strictly_and_stray_files_do_not_stop_gc(tmp_path, capsys):
    root = tmp_path / "c"
    make_run(str(root), steps=(1,))
    (root / "step-0000000001").mkdir()  # a second spelling of step 1: not a checkpoint
    (root / "step-000000007").write_text("not a directory")
    assert cli.main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows if r["status"] == "committed"] == [1]  # once, not twice
    assert cli.main(["gc", str(root), "--grace-s", "0"]) == 0
    assert (root / "step-000000007").exists()  # not ours: left alone


_STRAYS = ("file", "marker-directory", "empty-directory", "uncommitted-save")


def _make_stray(name, stray: str) -> None:
    """Something spelled like a step at `name` that no save made complete."""
    if stray == "file":
        name.write_text("notes")
    elif stray == "marker-directory":
        (name / "COMMITTED").mkdir(parents=True)
    elif stray == "empty-directory":
        name.mkdir()
    else:
        (name / "replicated").mkdir(parents=True)
        (name / "replicated" / "state.g000099.safetensors").write_bytes(b"unfinished")


@pytest.mark.parametrize("stray", ["file", "marker-directory", "empty-directory", "uncommitted-save"])
def test_a_stray_name_spelled_like_a_newer_step_is_skipped_by_loads_and_gc_does_what_its_dry_run_says(tmp_path, capsys, stray):
    """A file named like a step, or a directory where the marker should be, is not a checkpoint:
    load_latest resumes from the committed step below it, and `gc --dry-run` names exactly what
    `gc` then removes (a stray file is not ours: neither names it)."""
    import os
    import time

    root = tmp_path / "c"
    make_run(str(root), steps=(1,))
    name = root / "step-000000009"
    _make_stray(name, stray)
    old = time.time() - 3600
    os.utime(name, (old, old))
    state = {"model": nn.Linear(3, 2), "config": {"lr": 0.1},
             "sampler": torch.utils.data.DistributedSampler(list(range(10)), num_replicas=1, rank=0)}
    with distckpt.CheckpointManager(str(root)) as mgr:
        assert mgr.load_latest(state).step == 1
    capsys.readouterr()
    assert cli.main(["gc", str(root), "--grace-s", "0", "--dry-run", "--json"]) == 0
    would = json.loads(capsys.readouterr().out)["removed"]
    assert cli.main(["gc", str(root), "--grace-s", "0", "--json"]) == 0
    removed = json.loads(capsys.readouterr().out)["removed"]
    assert would == removed == ([] if stray == "file" else [9])
    assert name.exists() == (stray == "file")


def test_diff_of_an_unchanged_nan_is_no_change_and_json_is_valid(tmp_path, capsys):
    import torch

    import distckpt

    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save(1, {"t": torch.tensor([float("nan"), 1.0]), "m": {"x": float("nan")}})
        mgr.save(2, {"t": torch.tensor([float("nan"), 2.0]), "m": {"x": float("inf")}})
    assert cli.main(["diff", str(tmp_path / "c"), "1", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)  # strict JSON: no NaN / Infinity literals
    by_key = {r["key"]: r for r in rows}
    assert [r["changed_elements"] for r in rows if r["change"] == "values"] == [1]
    assert any(r.get("new") == "inf" for r in by_key.values())


def test_output_piped_into_head_prints_no_traceback(tmp_path):
    import distckpt

    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        for step in range(40):
            mgr.save(step, {"x": step})
    cmd = f"{sys.executable} -m distckpt ls {tmp_path / 'c'} | head -n 1"
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


@pytest.mark.parametrize("argv, needle", [
    (["gc", "{root}", "--grace-s", "nan"], "seconds"), (["gc", "{root}", "--grace-s", "-1"], "seconds"),
    (["verify", "{root}", "--step", "1", "--all"], "not allowed with"), (["inspect", "{root}", "--step", "-1"], "step"),
    (["diff", "{root}", "-1", "2"], "step"), (["export", "{root}", "out", "--step", "x"], "step"),
])
def test_a_bad_command_line_argument_is_a_usage_error_naming_it(tmp_path, capsys, argv, needle):
    root = str(tmp_path / "c")
    make_run(root, steps=(1,))
    with pytest.raises(SystemExit) as info:
        cli.main([a.format(root=root) for a in argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("which", [[], ["--all"]])
def test_verify_racing_a_writers_retention_reports_no_damage(tmp_path, monkeypatch, capsys, which):
    """The step being verified is removed by a running keep_last=1 writer: not damage; verify
    moves on to what is committed now and exits 0 (before: BAD, exit 1, in ~3% of runs)."""
    url = str(tmp_path / "ckpt")
    writer = distckpt.CheckpointManager(url, keep_last=1)
    writer.save(1, {"w": torch.ones(4)})
    from distckpt.tools import cli_commands

    real = cli_commands.verify_step

    def verify_while_the_writer_saves(storage, step, *args, **kwargs):
        if step == 1:
            writer.save(2, {"w": torch.full((4,), 2.0)})  # commits 2, removes 1
            writer._pruner.sweeper.drain()
        return real(storage, step, *args, **kwargs)

    monkeypatch.setattr(cli_commands, "verify_step", verify_while_the_writer_saves)
    assert cli.main(["verify", url, *which]) == 0
    assert capsys.readouterr().out.strip() == "step 2: ok"
    writer.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_inspect_shows_a_loaders_position_with_and_without_workers(tmp_path, capsys, workers):
    """With workers a StatefulDataLoader keeps its position inside a snapshot: inspect showed only
    `_iterator_finished`."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(distckpt.with_worker_rng(list(range(20))), batch_size=2, num_workers=workers)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with distckpt.CheckpointManager(str(tmp_path)) as mgr:
            mgr.save(0, {"loader": loader})
    del batches
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    position = json.loads(capsys.readouterr().out)["ranks"][0]["entries"]["loader"]["position"]
    assert position["_sampler_iter_yielded"] == 3 and position["_iterator_finished"] is False, position


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("step", ["2", "7"])  # pruned, never saved
def test_a_step_that_is_not_committed_is_said_to_be_so(url, capsys, command, step):
    # It was a raw "[Errno 2] .../COMMITTED does not exist" (verify called the step BAD).
    make_run(url, steps=(1, 3))
    code = cli.main([command, url, "--step", step])
    err = capsys.readouterr().err
    assert code == 2 and f"step {step} is not committed at" in err and "committed: [3, 1]" in err, err
    assert "Errno" not in err


def test_a_file_given_as_the_root_is_said_to_be_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert cli.main(["inspect", str(tmp_path / "afile")]) == 2
    assert "is a file, not a checkpoint root" in capsys.readouterr().err


def test_diff_text_abbreviates_long_values_and_json_keeps_them_whole(tmp_path, capsys):
    """An RNG state is hundreds of words: the text form showed each changed one whole (two steps
    printed ~600-number lists per rank), unreadable; it now shows the first items and the length."""
    url = str(tmp_path / "ckpt")
    with distckpt.CheckpointManager(url) as mgr:
        for step in (1, 2):
            random.random()
            np.random.rand()
            mgr.save(step, {"config": {"schedule": list(range(step, step + 500))}})
    code, out = run(capsys, "diff", url, "1", "2")
    assert code == 0 and "config" in out, out
    assert max(len(line) for line in out.splitlines()) < 250, out
    assert "list of 500 items, 500 differ (first at [0]: 1 -> 2)" in out, out
    code, out = run(capsys, "diff", url, "1", "2", "--json")
    rows = {r["key"]: r for r in json.loads(out)}
    schedule = next(r for k, r in rows.items() if k.endswith("config/state/schedule"))
    assert schedule["new"] == list(range(2, 502))


@pytest.mark.parametrize("text", ["\u0662", " 2", "2_0", "+2", "-1", "2.0"])
def test_a_step_on_the_command_line_is_ascii_digits_only(tmp_path, capsys, text):
    """int() took the Arabic-Indic digit two, ' 2' and '2_0' (as 20)."""
    url = str(tmp_path / "ckpt")
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(2, {"x": 1})
    with pytest.raises(SystemExit) as exited:
        cli.main(["inspect", url, "--step", text])
    assert exited.value.code == 2 and "is not a step number" in capsys.readouterr().err


def test_per_rank_of_per_rank_is_refused_where_it_is_written():
    with pytest.raises(distckpt.ConfigError, match=r"per_rank\(per_rank\(...\)\)"):
        distckpt.per_rank(distckpt.per_rank({"x": 1}))


def test_inspect_of_a_damaged_step_names_the_damaged_file(tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"x": torch.ones(3)})
        mgr.save(2, {"x": torch.ones(3)})
    folder = os.path.join(url, "step-000000002", "replicated")
    damaged = os.path.join(folder, os.listdir(folder)[0])
    open(damaged, "wb").close()
    capsys.readouterr()
    assert cli.main(["inspect", url, "--step", "2"]) == 1  # the step is damaged, said as such
    err = capsys.readouterr().err
    assert err.startswith(f"distckpt inspect: damaged: step 2 at {url}: ")
    assert f"{damaged}: 0 bytes" in err  # the damaged file named


def _as_an_unprivileged_reader(argv: list[str]) -> list[str]:
    """Run argv where file permissions bind: root ignores them unless its DAC capabilities go."""
    import shutil

    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: permissions cannot bind")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", *argv]


def test_an_unreadable_step_directory_is_listed_and_verified_as_such_not_hidden(tmp_path):
    """One unreadable step directory failed `ls` and `verify --all` as a whole (exit 2), hiding
    the readable steps; once that was mended, verify skipped it as "removed while verified"."""
    url = str(tmp_path / "ckpt")
    with distckpt.CheckpointManager(url) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": torch.full((3,), float(step))})
    unreadable = os.path.join(url, "step-000000003")
    os.chmod(unreadable, 0)
    try:
        cli_argv = [sys.executable, "-m", "distckpt"]
        ls = subprocess.run(_as_an_unprivileged_reader([*cli_argv, "ls", url, "--json"]), capture_output=True, text=True)
        verify = subprocess.run(_as_an_unprivileged_reader([*cli_argv, "verify", url, "--all"]),
                                capture_output=True, text=True)
    finally:
        os.chmod(unreadable, 0o755)
    assert ls.returncode == 0, ls.stderr
    rows = {r["step"]: r["status"] for r in json.loads(ls.stdout)}
    assert rows[1] == rows[2] == "committed" and rows[3].startswith("damaged:") and "Permission denied" in rows[3], rows
    assert verify.returncode == 1, verify.stderr
    assert "step 1: ok" in verify.stdout and "step 2: ok" in verify.stdout and "step 3: BAD" in verify.stdout
    assert "Permission denied" in verify.stdout


def _steps_1_2_and_a_stray_step_9(tmp_path, stray: str):
    import shutil

    root = tmp_path / "c"
    make_run(str(root), steps=(1, 2))
    name = root / "step-000000009"
    if stray in _STRAYS:
        _make_stray(name, stray)
    elif stray == "symlinked-step":
        shutil.copytree(root / "step-000000002", tmp_path / "elsewhere")
        name.symlink_to(tmp_path / "elsewhere")
    else:
        name.symlink_to(tmp_path / "nothing-here")
    return root


@pytest.mark.parametrize("stray", ["file", "marker-directory", "empty-directory", "uncommitted-save",
                                   "symlinked-step", "dangling-symlink"])
def test_verify_without_a_step_judges_the_newest_step_as_ls_lists_it(tmp_path, capsys, stray):
    """`ls` listed a step directory replaced by a symbolic link as damaged and load_latest fell
    back past it, while `verify` (newest step) said "step 2: ok": the whole-root listing does not
    follow links. verify now takes the newest step as load_latest does, so each tool tells the
    same story of the newest entry spelled like a step."""
    root = _steps_1_2_and_a_stray_step_9(tmp_path, stray)
    assert cli.main(["ls", str(root), "--json"]) == 0
    listed = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    code = cli.main(["verify", str(root), "--json"])
    rows = json.loads(capsys.readouterr().out)
    if listed[9].startswith("damaged"):
        assert code == 1 and [r["step"] for r in rows] == [9] and not rows[0]["ok"]
    else:
        assert listed[9] == "uncommitted"
        assert code == 0 and [(r["step"], r["ok"]) for r in rows] == [(2, True)]
    assert listed[9].startswith("damaged") == (stray in ("file", "marker-directory", "symlinked-step"))


@pytest.mark.parametrize("stray", ["file", "marker-directory", "empty-directory", "uncommitted-save",
                                   "symlinked-step", "dangling-symlink"])
def test_inspect_without_a_step_says_a_damaged_newest_step_as_ls_lists_it(tmp_path, capsys, stray):
    """inspect (newest step) described step 2 and said nothing of step 9, a step directory
    replaced by a symbolic link that `ls` lists as damaged and load_latest passes over saying so;
    then it said so and still exited 0, as if the newest step were fine."""
    root = _steps_1_2_and_a_stray_step_9(tmp_path, stray)
    assert cli.main(["ls", str(root), "--json"]) == 0
    listed = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    damaged = listed[9].startswith("damaged")
    code = cli.main(["inspect", str(root), "--json"])
    out = capsys.readouterr()
    described = json.loads(out.out)
    assert code == (1 if damaged else 0) and described["manifest"]["step"] == 2
    assert ("step 9" in out.err) == damaged, (listed[9], out.err)
    assert [p["step"] for p in described.get("passed_over", [])] == ([9] if damaged else [])


@pytest.mark.parametrize("argv, said", [
    (["export", "{root}", "{out}", "--max-shard-size", "-1GB"], "max_shard_size='-1GB': a size such as"),
    (["prune", "{root}", "--keep-last", "-1"], "--keep-last must be >= 1"),
    (["verify", "{root}", "--step", "-2"], "is not a step number"),
])
def test_an_option_value_starting_with_a_dash_is_judged_by_the_option(tmp_path, capsys, argv, said):
    """`--max-shard-size -1GB` was taken for an option by argparse, which said only "expected one
    argument"; the value now reaches the option's own check."""
    root = tmp_path / "c"
    make_run(str(root), steps=(1,))
    try:
        code = cli.main([a.format(root=root, out=tmp_path / "o") for a in argv])
    except SystemExit as e:  # argparse's own refusal of a value (exit status 2, said on stderr)
        code = e.code
    assert code == 2 and said in capsys.readouterr().err

"""What people see: the resume line, warnings that point at their own code, and a command line
that starts at once, says which steps were verified, groups what it shows and refuses bad input
with exit 2 (one JSON document with --json), never a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import distckpt
from distckpt import errors
from distckpt.testing import run_world

# --- warnings at the user's line, and the one resume line -------------------------------------------


def _warn_from_depth(depth: int) -> int:
    """A library-like call chain `depth` frames deep inside distckpt (the frames' module names say
    where they belong), ending in errors.warn. Returns the line of the call into it."""
    code = "def chain(n):\n    if n == 0:\n        warn('deep', DistCkptWarning)\n    else:\n        chain(n - 1)\n"
    namespace = {"__name__": "distckpt.protocol.fake", "warn": errors.warn, "DistCkptWarning": errors.DistCkptWarning}
    exec(compile(code, "<distckpt-internal>", "exec"), namespace)
    namespace["chain"](depth); return sys._getframe().f_lineno  # noqa: E702  (the call's own line)


@pytest.mark.parametrize("depth", [0, 1, 5, 30])
def test_a_warning_points_at_the_first_frame_outside_distckpt(depth):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _warn_from_depth(depth)
    assert [(w.filename, w.lineno, w.category) for w in caught] == [(__file__, line, errors.DistCkptWarning)]


def test_a_warning_from_a_library_thread_points_at_the_line_that_warned():
    """A thread of the library (no frame of the user's above it): the distckpt line that warned,
    not threading's line that started the thread."""
    import threading

    code = "def run(caught):\n    with catch_warnings(record=True) as got:\n        simplefilter('always')\n" \
           "        warn('from a thread', DistCkptWarning)\n    caught.extend(got)\n"
    namespace = {"__name__": "distckpt.protocol.fake", "warn": errors.warn, "DistCkptWarning": errors.DistCkptWarning,
                 "catch_warnings": warnings.catch_warnings, "simplefilter": warnings.simplefilter}
    exec(compile(code, "<distckpt-thread>", "exec"), namespace)
    caught: list[warnings.WarningMessage] = []
    thread = threading.Thread(target=namespace["run"], args=(caught,))
    thread.start()
    thread.join()
    assert [(w.filename, w.lineno) for w in caught] == [("<distckpt-thread>", 4)]


def _damaged_newest(url: str) -> nn.Module:
    model = nn.Linear(3, 2)
    with distckpt.CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": model}, epoch=step)
    folder = os.path.join(url, "step-000000002", "replicated")
    path = os.path.join(folder, os.listdir(folder)[0])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(data)
    return model


def _imported(url: str, tmp_path) -> nn.Module:
    """A checkpoint imported from a torch.save file: it holds no per-rank state (ReshardWarning)."""
    from distckpt.tools.importing import import_torch

    model = nn.Linear(3, 2)
    torch.save({"model": model.state_dict()}, tmp_path / "whole.pt")
    import_torch(str(tmp_path / "whole.pt"), url, trust_pickle=True)
    return model


def _missing_entry(url: str, tmp_path) -> nn.Module:
    """A checkpoint without an entry the loading state holds (missing_entries='keep': CheckpointWarning)."""
    model = nn.Linear(3, 2)
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"model": model})
    return model


@pytest.mark.parametrize("make, options, category", [
    (lambda url, tmp_path: _damaged_newest(url), {}, distckpt.CheckpointFallbackWarning),
    (_imported, {}, distckpt.ReshardWarning),
    (_missing_entry, {"missing_entries": "keep"}, distckpt.CheckpointWarning),
])
def test_a_load_warning_points_at_the_users_load_latest_line(tmp_path, make, options, category):
    url = str(tmp_path / "c")
    model = make(url, tmp_path)
    mgr = distckpt.CheckpointManager(url, **options)
    state = {"model": model, "extra": torch.zeros(2)} if options else {"model": model}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress = mgr.load_latest(state); line = sys._getframe().f_lineno  # noqa: E702  (the call's own line)
    mgr.close()
    said = [(w.filename, w.lineno) for w in caught if w.category is category]
    assert progress is not None and said == [(__file__, line)], [(w.category, w.filename, w.lineno) for w in caught]


_SCRIPT = """
import logging, shutil, sys, torch, distckpt
url = sys.argv[1]
model = torch.nn.Linear(3, 2)
if len(sys.argv) > 2 and sys.argv[2] == "configured":
    logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
if len(sys.argv) > 2 and sys.argv[2] == "quiet":
    logging.getLogger("distckpt").setLevel(logging.WARNING)
mgr = distckpt.CheckpointManager(url)
progress = mgr.load_latest({"model": model})
mgr.close()
"""


def _run_script(tmp_path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return subprocess.run([sys.executable, str(script), url, *extra], capture_output=True, text=True, timeout=120)


def test_a_resume_says_one_line_and_a_fallback_one_warning_at_the_users_line(tmp_path):
    url = str(tmp_path / "c")
    _damaged_newest(url)
    done = _run_script(tmp_path, url)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    # the warning (its line, then the user's source line), then the resume: nothing else
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"{tmp_path / 'train.py'}:10: CheckpointFallbackWarning: rank 0: committed step 2 "
                               "cannot be loaded"), lines[0]
    assert lines[1].strip() == 'progress = mgr.load_latest({"model": model})'
    assert lines[2] == f"distckpt: resumed from step 1 (epoch 1) at {url}/step-000000001"


@pytest.mark.parametrize("how, said", [
    ("plain", "distckpt: {what}"),        # logging unconfigured: on stderr, else never seen
    ("configured", "LOG {what}"),         # logging configured: through it, once
    ("quiet", None),                      # the "distckpt" logger set above INFO: nothing
])
@pytest.mark.parametrize("saved", [False, True])
def test_the_resume_line_goes_where_the_user_looks(tmp_path, how, said, saved):
    url = str(tmp_path / "c")
    if saved:
        with distckpt.CheckpointManager(url) as mgr:
            mgr.save(4, {"model": nn.Linear(3, 2)}, epoch=1)
    done = _run_script(tmp_path, url, how)
    assert done.returncode == 0, done.stderr
    what = (f"resumed from step 4 (epoch 1) at {url}/step-000000004" if saved
            else f"no committed checkpoint at {url}: starting fresh")
    if said is None:
        assert done.stderr == ""
    else:
        assert said.format(what=what) in done.stderr.splitlines(), done.stderr
        assert done.stderr.count(what) == 1, done.stderr


def resume_on_two_ranks(rank: int, world: int, url: str) -> str:
    """Runs on each rank: what load_latest wrote to stderr there."""
    state = {"w": torch.full((2,), float(rank))}
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        mgr.save(3, {"w": torch.ones(2)}, epoch=0)
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            mgr.load_latest(state)
    return said.getvalue()


def test_only_rank_0_says_the_resume(tmp_path):
    results = run_world("test_cli_people:resume_on_two_ranks", 2, url=str(tmp_path / "c"))
    assert [r.error for r in results] == [None, None], results
    said = [r.value for r in results]
    assert said == [f"distckpt: resumed from step 3 (epoch 0) at {tmp_path / 'c'}/step-000000003\n", ""], said


def test_configured_logging_gets_a_warning_once_and_unconfigured_logging_not_twice(tmp_path, caplog):
    """Logged too when logging is configured (pytest's capture is a handler); the last-resort
    handler of unconfigured logging printed every warning a second time (see the script test)."""
    with caplog.at_level(logging.WARNING, logger="distckpt"), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _warn_from_depth(2)
    assert [r.getMessage() for r in caplog.records] == ["deep"]


# --- the command line starts at once: no torch for --help or a refused argument ----------------------

_HELPS = [[], *[[name] for name in ("ls", "inspect", "verify", "prune", "gc", "diff", "export", "import-torch",
                                    "import-dcp", "doctor")]]
_REFUSED = [["export", "root", "out", "--max-shard-size", "1iB"], ["inspect", "root", "--step", "-1"],
            ["prune", "root", "--keep-last", "x"], ["gc", "root", "--grace-s", "nan", "--json"],
            ["doctor", "--kill-at", "1e400", "--", "true"], ["nonsense"]]


def _torch_modules_after(argv: list[str]) -> tuple[int, list[str]]:
    """Run the command line's main in a fresh interpreter: its exit code and the torch modules it imported."""
    code = ("import sys\nfrom distckpt.tools.cli import main\n"
            f"try:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    exit_code, _, modules = done.stdout.strip().splitlines()[-1].partition(" ")
    return int(exit_code), eval(modules)


@pytest.mark.parametrize("argv", [[*command, "--help"] for command in _HELPS] + _REFUSED,
                         ids=lambda argv: " ".join(argv))
def test_help_and_a_refused_argument_import_no_torch(argv):
    code, torch_modules = _torch_modules_after(argv)
    assert code == (0 if "--help" in argv else 2) and torch_modules == [], (code, torch_modules)


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["doctor", "--help"]])
def test_python_dash_m_distckpt_help_imports_no_torch(argv):
    """As people run it: `python -m distckpt ... --help`, every import it makes listed by -X importtime."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "distckpt", *argv], capture_output=True,
                          text=True, timeout=120)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert done.returncode == 0 and "distckpt.tools.cli" in imported, done.stderr[-2000:]
    assert [m for m in imported if m == "torch" or m.startswith("torch.")] == []
    assert "usage: distckpt" in done.stdout


def test_the_parser_bounds_a_step_as_save_does():
    from distckpt.state.validation import LARGEST_COUNT
    from distckpt.tools import cli

    assert cli.LARGEST_COUNT == LARGEST_COUNT


# --- ls --verify ---------------------------------------------------------------------------------------


def _flip_a_byte(url: str, step: int, which: str) -> None:
    folder = os.path.join(url, f"step-{step:09d}", which)
    path = os.path.join(folder, sorted(os.listdir(folder))[0])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(data)


def _truncate(url: str, step: int, which: str) -> None:
    folder = os.path.join(url, f"step-{step:09d}", which)
    path = os.path.join(folder, sorted(os.listdir(folder))[0])
    os.truncate(path, os.path.getsize(path) // 2)


def _remove(url: str, step: int, which: str) -> None:
    folder = os.path.join(url, f"step-{step:09d}", which)
    os.remove(os.path.join(folder, sorted(os.listdir(folder))[0]))


def _three_steps(url: str) -> None:
    model = nn.Linear(4, 3)
    with distckpt.CheckpointManager(url) as mgr:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step, {"model": model, "config": {"step": step}}, epoch=0, metric=float(step))


def _cli(*argv: str) -> tuple[int, str, str]:
    """main() in this process: (exit code, stdout, stderr); a SystemExit's code counts as its exit code."""
    from distckpt.tools import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _remove])
@pytest.mark.parametrize("which", ["replicated", "ranks"])
def test_ls_verify_shows_a_step_whose_payload_is_damaged_as_damaged(tmp_path, damage, which):
    url = str(tmp_path / "c")
    _three_steps(url)
    _, plain_before, _ = _cli("ls", url, "--json")
    damage(url, 2, which)
    code, plain, _ = _cli("ls", url, "--json")
    assert code == 0 and plain == plain_before  # the marker alone: --json exactly as before, all "committed"
    code, text, _ = _cli("ls", url)
    statuses = [line.split("  ")[-1] for line in text.splitlines()[1:4]]
    assert code == 0 and statuses == ["committed (unverified)"] * 3, text
    code, verified, _ = _cli("ls", url, "--verify", "--json")
    rows = {r["step"]: r for r in json.loads(verified)}
    assert code == 1
    assert rows[1]["verified"] is rows[3]["verified"] is True and rows[2]["verified"] is False
    assert rows[2]["status"].startswith("damaged: ") and f"step-000000002/{which}/" in rows[2]["status"]
    code, text, _ = _cli("ls", url, "--verify")
    by_step = {int(line.split()[0]): line for line in text.splitlines()[1:]}
    assert code == 1 and by_step[1].endswith("committed, verified") and by_step[3].endswith("committed, verified")
    assert "damaged: " in by_step[2] and f"step-000000002/{which}/" in by_step[2], text


def test_ls_verify_of_healthy_steps_exits_0_and_keeps_the_plain_columns(tmp_path):
    url = str(tmp_path / "c")
    _three_steps(url)
    _, plain, _ = _cli("ls", url, "--json")
    code, verified, _ = _cli("ls", url, "--verify", "--json")
    assert code == 0
    for before, after in zip(json.loads(plain), json.loads(verified)):
        assert after == {**before, "verified": True}


def test_ls_verify_racing_a_writers_retention_reports_no_damage(tmp_path, monkeypatch):
    """A step a running keep_last=1 writer removes while `ls --verify` reads it is no damage."""
    from distckpt.tools import cli_commands

    url = str(tmp_path / "c")
    writer = distckpt.CheckpointManager(url, keep_last=1)
    writer.save(1, {"w": torch.ones(4)})
    real = cli_commands.verify_step

    def verify_while_the_writer_saves(storage, step, *args, **kwargs):
        if step == 1:
            writer.save(2, {"w": torch.full((4,), 2.0)})  # commits 2, removes 1
            writer._pruner.sweeper.drain()
        return real(storage, step, *args, **kwargs)

    monkeypatch.setattr(cli_commands, "verify_step", verify_while_the_writer_saves)
    code, out, _ = _cli("ls", url, "--verify", "--json")
    writer.close()
    rows = json.loads(out)
    assert code == 0 and [(r["step"], r["verified"]) for r in rows] == [(1, None)], rows
    assert rows[0]["status"].startswith("removed while it was verified"), rows


def test_ls_verify_of_two_tiers_says_which_copy_is_damaged(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with distckpt.CheckpointManager(durable, local_dir=local, durable_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    _flip_a_byte(local, 1, "replicated")
    code, out, _ = _cli("ls", durable, "--local-dir", local, "--verify", "--json")
    verdicts = {(r["step"], r["tier"]): r["verified"] for r in json.loads(out)}
    assert code == 1 and verdicts == {(1, "durable"): True, (1, "local"): False, (2, "durable"): True,
                                      (2, "local"): True}, verdicts


def test_ls_verify_on_s3(s3_server, s3_url, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    _three_steps(s3_url)
    from distckpt.storage import open_storage

    storage = open_storage(s3_url)
    name = next(n for n in storage.list_dir("step-000000003/replicated"))
    path = f"step-000000003/replicated/{name}"
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 1
    storage.write_file(path, [bytes(data)])
    code, out, _ = _cli("ls", s3_url, "--verify", "--json")
    assert code == 1 and [r["verified"] for r in json.loads(out)] == [True, True, False]


# --- inspect: one line per entry; --tensors in natural order ----------------------------------------


def _wide_model(layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(layers)])


def test_inspect_of_a_400_tensor_model_says_one_line_per_entry(tmp_path):
    url = str(tmp_path / "c")
    model = _wide_model(200)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2)).sum().backward()
    optimizer.step()
    g = torch.Generator().manual_seed(1)
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"model": model, "optimizer": optimizer, "gen": distckpt.per_rank(g), "config": {"lr": 0.1}})
    code, text, _ = _cli("inspect", url)
    assert code == 0 and len(text.splitlines()) < 40, text
    assert "state_dict" not in text and "replicated/" not in text  # no key paths, no storage paths
    lines = text.splitlines()
    table = lines[lines.index("entries (4):") + 1:]
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in table if line.startswith("  "))}
    state = model.state_dict()
    assert rows["model"][1:] == ["module", "replicated", f"{len(state):,}",
                                 f"{sum(t.numel() * t.element_size() for t in state.values()):,}", "float32"]
    momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    assert rows["optimizer"][3] == f"{len(momentum)}"
    assert rows["gen"][1:4] == ["generator", "per-rank (1 rank)", "1"]
    entries = [r for k, r in rows.items() if k not in ("entry", "total")]
    assert rows["total"][1:] == [f"{sum(int(r[3].replace(',', '')) for r in entries):,}",
                                 f"{sum(int(r[4].replace(',', '')) for r in entries):,}"]


def test_inspect_tensors_lists_every_tensor_in_natural_order(tmp_path):
    url = str(tmp_path / "c")
    model = _wide_model(12)
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"model": model})
    code, text, _ = _cli("inspect", url, "--tensors")
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  model/")]
    keys = sorted(model.state_dict(), key=lambda k: (int(k.split(".")[0]), k.split(".")[1]))  # 0, 1, ..., 10, 11
    assert code == 0 and listed == [f"model/state_dict/{k}" for k in keys], listed
    assert listed.index("model/state_dict/2.weight") < listed.index("model/state_dict/10.weight")
    for key, tensor in model.state_dict().items():
        line = next(line for line in text.splitlines() if line.split()[0] == f"model/state_dict/{key}")
        assert str(list(tensor.shape)) in line and line.rstrip().endswith(f"{tensor.numel() * tensor.element_size():,}")


@settings(max_examples=int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40")), derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["layers", "blocks", "h"]), st.integers(0, 10**6),
                          st.sampled_from(["weight", "bias", "attn.0.w"])), min_size=1, max_size=30))
def test_natural_order_sorts_numbers_by_value(parts):
    from distckpt.tools.cli_text import natural_key

    names = [f"{a}.{n}.{b}" for a, n, b in parts]
    ordered = sorted(names, key=natural_key)
    expected = sorted(names, key=lambda s: (s.split(".")[0], int(s.split(".")[1]), natural_key(s.split(".", 2)[2])))
    assert ordered == expected


# --- diff: a summary first --------------------------------------------------------------------------


def test_diff_starts_with_a_summary_of_entries_and_the_largest_changes(tmp_path):
    url = str(tmp_path / "c")
    model, other = nn.Linear(4, 4), nn.Linear(2, 2)
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"model": model, "other": other, "gone": {"x": 1}, "same": torch.ones(3)})
        with torch.no_grad():
            model.weight[0, 0] += 5.0
            model.bias.add_(0.5)
            other.weight.mul_(-1)
        mgr.save(2, {"model": model, "other": other, "new": {"y": 2}, "same": torch.ones(3)})
    code, rows_json, _ = _cli("diff", url, "1", "2", "--json")
    from distckpt.storage import open_storage
    from distckpt.tools.inspection import diff_steps

    assert code == 0 and json.loads(rows_json) == json.loads(json.dumps(diff_steps(open_storage(url), 1, 2)))
    code, text, _ = _cli("diff", url, "1", "2")
    lines = text.splitlines()
    assert code == 0 and lines[0] == "steps 1 -> 2: 5 entries: 1 equal, 2 changed, 1 added, 1 removed", lines[0]
    assert "  added: new" in lines and "  removed: gone" in lines
    by_entry = lines[lines.index("changes by entry:") + 1:lines.index("largest changes (most elements changed):")]
    assert [line.split()[0] for line in by_entry] == ["model", "other"]
    # model: one weight element moved by 5, every bias element by 0.5; other: every weight element flipped sign
    assert by_entry[0].split(None, 1)[1] == \
        f"2 tensors, {1 + model.bias.numel()} elements, max |diff| 5 (model/state_dict/weight)"
    assert by_entry[1].split(None, 1)[1].startswith(f"1 tensor, {other.weight.numel()} elements, max |diff| ")
    largest = lines[lines.index("largest changes (most elements changed):") + 1:lines.index("details:")]
    moved = sorted([(other.weight.numel(), float(other.weight.detach().abs().max() * 2), "other/state_dict/weight"),
                    (model.bias.numel(), 0.5, "model/state_dict/bias"), (1, 5.0, "model/state_dict/weight")],
                   key=lambda m: (-m[0], -m[1]))
    assert [line.split(":")[0].strip() for line in largest] == [name for _, _, name in moved], largest
    details = lines[lines.index("details:") + 1:]
    assert len(details) == len(json.loads(rows_json))  # then every change, as before


# --- progress bars: on a terminal only, never with --json ---------------------------------------------


def _stderr_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    done = subprocess.Popen([sys.executable, "-m", "distckpt", *argv], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    said = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        said += chunk
    done.stdout.read()
    os.close(master)
    return done.wait(timeout=120), said.decode(errors="replace")


def _bar_cases(tmp_path) -> dict[str, list[str]]:
    url = str(tmp_path / "c")
    model = nn.Linear(64, 64)
    with distckpt.CheckpointManager(url) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"model": model})
    for step in (7, 8):  # leftovers for gc
        os.makedirs(os.path.join(url, f"step-{step:09d}", "replicated"))
        open(os.path.join(url, f"step-{step:09d}", "replicated", "x"), "wb").write(b"partial")
    torch.save({"model": model.state_dict()}, tmp_path / "whole.pt")
    return {"verify": ["verify", url, "--all"], "ls --verify": ["ls", url, "--verify"],
            "export": ["export", url, str(tmp_path / "hf")], "prune": ["prune", url, "--keep-last", "1"],
            "gc": ["gc", url, "--grace-s", "0"],
            "import": ["import-torch", str(tmp_path / "whole.pt"), str(tmp_path / "imported"), "--trust-pickle"]}


_BAR_NAMES = {"verify": "verify", "ls --verify": "verify", "export": "export", "prune": "prune", "gc": "gc",
              "import": "import"}


@pytest.mark.parametrize("case", [c if c == "verify" else pytest.param(c, marks=pytest.mark.faults)  # make test: verify
                                  for c in _BAR_NAMES])
def test_long_commands_show_a_progress_bar_on_a_terminal_only(tmp_path, case):
    argv = _bar_cases(tmp_path / "a")[case]
    code, terminal = _stderr_on_a_terminal(argv)
    assert code == 0 and f"{_BAR_NAMES[case]}:" in terminal and "%|" in terminal, terminal
    argv = _bar_cases(tmp_path / "b")[case]
    code, terminal = _stderr_on_a_terminal([*argv, "--json"])
    assert code == 0 and "%|" not in terminal, terminal
    argv = _bar_cases(tmp_path / "c")[case]
    piped = subprocess.run([sys.executable, "-m", "distckpt", *argv], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "%|" not in piped.stderr, piped.stderr


# --- bad input: exit 2 and one JSON document naming it, never a traceback ---------------------------

EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40")) // 2 or 1
_LARGEST = 2**63 - 1

numbers = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.integers(_LARGEST - 2, _LARGEST + 2).map(str),
    st.integers(10**18, 10**400).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "-", "--", "1e400", "-0", "0x10", "1_000", "\u0662", "1.5", "nan", "inf", "-inf",
                     "+3", " 2", "2 ", "9" * 400, "-" + "9" * 400]),
    st.text(alphabet="0123456789.-+eE ", max_size=12),
)
sizes = st.one_of(numbers, st.builds(lambda n, unit: f"{n}{unit}", numbers,
                                     st.sampled_from(["B", "iB", "KB", "kb", "KiB", "MiB", "GB", " GB", "GiB", "TB",
                                                      "TiB", "PB", "XB", "b", "G"])))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A healthy root (steps 1, 2), a torch.save file and a DCP directory to import."""
    base = tmp_path_factory.mktemp("sources")
    root = str(base / "root")
    model = nn.Linear(3, 2)
    with distckpt.CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": model}, epoch=0)
    torch.save({"model": model.state_dict()}, base / "whole.pt")
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(base / "dcp"))
    return {"root": root, "file": str(base / "whole.pt"), "dcp": str(base / "dcp"), "base": base}


def _fresh(base) -> str:
    import tempfile

    return tempfile.mkdtemp(dir=base, prefix="new-") + "/root"


# (command line with {v} for the value, the name an error about the value must hold)
_OPTIONS = [
    (["inspect", "{root}", "--step", "{v}"], "step"),
    (["verify", "{root}", "--step", "{v}"], "step"),
    (["export", "{root}", "{out}", "--step", "{v}"], "step"),
    (["prune", "{root}", "--keep-last", "{v}", "--dry-run"], "keep-last"),
    (["prune", "{root}", "--keep-last", "5", "--keep-best", "{v}", "--dry-run"], "keep-best"),
    (["gc", "{root}", "--grace-s", "{v}", "--dry-run"], "grace-s"),
    (["diff", "{root}", "{v}", "1"], "argument a"),
    (["diff", "{root}", "1", "{v}"], "argument b"),
    (["import-torch", "{file}", "{new}", "--trust-pickle", "--step", "{v}"], "step"),
    (["import-torch", "{file}", "{new}", "--trust-pickle", "--world-size", "{v}"], "world-size"),
    (["import-dcp", "{dcp}", "{new}", "--trust-pickle", "--step", "{v}"], "step"),
    (["import-dcp", "{dcp}", "{new}", "--trust-pickle", "--world-size", "{v}"], "world-size"),
    *[(["doctor", "--json", option, "{v}", "--", "/nonexistent/launcher"], option.lstrip("-"))
      for option in ("--kill-at", "--steps", "--kill-rank", "--every", "--timeout")],
]
# what a refusal of a valid value says instead (nothing to do with the value)
_NOT_THE_VALUE = ("is not committed", "/nonexistent/launcher", "no committed step", "No such file")


def _judge(sources, argv_template: list[str], name: str, value: str) -> None:
    fields = {"root": sources["root"], "out": str(sources["base"] / "out"), "file": sources["file"],
              "dcp": sources["dcp"], "new": _fresh(sources["base"]), "v": value}
    argv = [a.format(**fields) if a != "{v}" else value for a in argv_template]
    if argv[0] != "doctor":
        argv.insert(1, "--json")  # before the value: a value "--" ends the options
    code, out, err = _cli(*argv)
    assert code in (0, 2), (argv, code, out, err)  # never 1 (nothing here is damaged), never a traceback
    assert "Traceback" not in err, err
    document = json.loads(out)  # exactly one JSON document, whatever happened
    if code == 2:
        said = document["error"].replace("_", "-")
        assert document["exit_code"] == 2
        # "--" is the end of the options, not a value: a positional after it is then said to be missing
        names = [name, "arguments are required"] if value == "--" else [name]
        assert any(n in said for n in names) or any(n in document["error"] for n in _NOT_THE_VALUE), (argv, document)


@pytest.mark.parametrize("argv, name", _OPTIONS, ids=[" ".join(a[:1] + a[2:]) for a, _ in _OPTIONS])
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=numbers)
@example(value="9" * 400)
@example(value="1e400")
@example(value="-1")
@example(value=str(_LARGEST + 1))
def test_every_numeric_option_takes_its_values_or_refuses_them_with_exit_2(sources, argv, name, value):
    _judge(sources, argv, name, value)


@settings(max_examples=EXAMPLES * 4, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=sizes)
@example(value="1iB")
@example(value="9" * 400)
@example(value="9" * 400 + "GB")
@example(value="0.0000000001GB")
@example(value="\u0662GB")
@example(value=str(2**63) + "B")
def test_max_shard_size_takes_a_size_or_refuses_it_with_exit_2(sources, value):
    _judge(sources, ["export", "{root}", "{out}", "--max-shard-size", "{v}"], "max-shard-size", value)


@settings(max_examples=EXAMPLES * 4, derandomize=True, deadline=None)
@given(value=st.one_of(sizes, st.integers(-(10**30), 10**30), st.floats(), st.none(), st.booleans()))
def test_parse_size_returns_a_size_in_range_or_raises_config_error(value):
    from distckpt.tools.sizes import LARGEST_SIZE, parse_size

    try:
        size = parse_size(value)
    except distckpt.ConfigError as e:
        assert "max_shard_size=" in str(e)
        return
    assert isinstance(size, int) and 1 <= size <= LARGEST_SIZE


@pytest.mark.parametrize("size", ["1iB", "9" * 400, "9" * 400 + "GB", "0.1B", "\u0662MB", str(2**63) + "B"])
def test_export_weights_refuses_a_size_it_cannot_take_with_config_error(sources, size):
    """export_weights (the API under `export`) met '1iB' with KeyError and a 400-digit size with
    OverflowError; every size it cannot take is a ConfigError naming it, before anything is read."""
    with pytest.raises(distckpt.ConfigError, match="max_shard_size="):
        distckpt.export_weights(sources["root"], str(sources["base"] / "api-out"), max_shard_size=size)


def test_an_export_of_a_model_with_a_metadata_key_is_refused_naming_it(tmp_path):
    """A state_dict key "__metadata__" (an import of any torch.save file can hold one) ended in
    safetensors' raw SafetensorError at the read-back, exit 1."""
    torch.save({"model": {"__metadata__": torch.ones(2), "w": torch.ones(3)}}, tmp_path / "m.pt")
    url = str(tmp_path / "imported")
    assert _cli("import-torch", str(tmp_path / "m.pt"), url, "--trust-pickle")[0] == 0
    code, out, err = _cli("export", url, str(tmp_path / "hf"), "--json")
    assert code == 2 and "__metadata__" in json.loads(out)["error"] and "Traceback" not in err
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")


# --- inspect: a damaged newest step is said, and the exit code says it ------------------------------


def _flip_last_byte(folder: str) -> None:
    """One bit of a payload's tensor bytes (its end): the header still parses, only the checksum
    can tell."""
    path = os.path.join(folder, sorted(os.listdir(folder))[0])
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


@pytest.mark.parametrize("damage", ["truncated header", "no manifest", "garbage marker",
                                    "replicated checksum", "rank file checksum"])
def test_inspect_passing_over_a_damaged_newest_step_says_which_and_why_and_exits_1(tmp_path, damage):
    """Without --step, inspect describes the step load_latest loads, after saying each damaged one
    above it; with --step, a damaged step is said to be damaged (exit 1)."""
    url = str(tmp_path / "c")
    _three_steps(url)
    step3 = os.path.join(url, "step-000000003")
    if damage.endswith("checksum"):
        _flip_last_byte(os.path.join(step3, "replicated" if damage.startswith("replicated") else "ranks"))
    elif damage == "truncated header":
        folder = os.path.join(step3, "replicated")
        os.truncate(os.path.join(folder, os.listdir(folder)[0]), 4)
    elif damage == "no manifest":
        os.remove(os.path.join(step3, "manifest.json"))
    else:
        open(os.path.join(step3, "COMMITTED"), "w").write("garbage")
    code, text, err = _cli("inspect", url)
    assert code == 1 and text.splitlines()[0].startswith(f"damaged: step 3 at {url}: "), text
    assert "step 2  epoch 0" in text and "an older step" in text and "step 3" in err
    code, out, _ = _cli("inspect", url, "--json")
    described = json.loads(out)
    assert code == 1 and described["manifest"]["step"] == 2
    assert [p["step"] for p in described["passed_over"]] == [3] and described["passed_over"][0]["error"]
    assert _cli("inspect", url, "--step", "2")[0] == 0  # asked for by name: nothing passed over
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_latest warns of the step it passes over
        loaded = distckpt.CheckpointManager(url).load_latest({"model": nn.Linear(4, 3), "config": {"step": 0}})
    assert loaded is not None and loaded.step == described["manifest"]["step"]
    if damage != "garbage marker":  # a step whose marker is garbage is not committed: --step refuses it otherwise
        code, _, err = _cli("inspect", url, "--step", "3")
        assert code == 1 and err.startswith(f"distckpt inspect: damaged: step 3 at {url}: "), err

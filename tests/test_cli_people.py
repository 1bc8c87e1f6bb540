"""What people see: the resume line, warnings that point at their own code, and a command line
that starts at once, says which steps were verified, groups what it shows and refuses bad input
with exit 2 (one JSON document with --json), never a traceback."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
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

"""The manifest's environment: git's answer started at construction, read at the first save,
never holding a save up (versions.VersionsProbe)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import pytest
import torch

import distckpt
from distckpt.runtime import versions

SCRIPT = """
import sys, torch, distckpt
with distckpt.CheckpointManager(sys.argv[1]) as mgr:
    mgr.save(1, {"w": torch.zeros(2)})
"""


def _manifest_versions(root) -> dict:
    with open(os.path.join(root, "step-000000001", "manifest.json")) as f:
        return json.load(f)["versions"]


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@example.org", "-c", "user.name=t",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


def _committed_repo(tmp_path):
    """A git repository holding SCRIPT as train.py in one commit: (its directory, the commit)."""
    repo = tmp_path / "code"
    repo.mkdir()
    (repo / "train.py").write_text(SCRIPT)
    _git(repo, "init", "-q")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-q", "-m", "first")
    return repo, _git(repo, "rev-parse", "HEAD")


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="no git")
def test_the_manifest_names_the_training_codes_commit_and_whether_tracked_files_changed(tmp_path):
    repo, head = _committed_repo(tmp_path)
    _git(repo, "tag", "v1")  # a tag must not replace the commit's name

    def saved_commit(run: str) -> str | None:
        root = tmp_path / run
        subprocess.run([sys.executable, str(repo / "train.py"), str(root)], check=True, cwd=str(tmp_path))
        return _manifest_versions(root)["git_commit"]

    assert saved_commit("clean") == head
    (repo / "notes.txt").write_text("untracked files do not make the tree dirty")
    assert saved_commit("untracked") == head
    (repo / "train.py").write_text(SCRIPT + "# changed\n")
    assert saved_commit("dirty") == head + "-dirty"
    # outside any git tree: unknown, not an error
    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "train.py").write_text(SCRIPT)
    subprocess.run([sys.executable, str(outside / "train.py"), str(tmp_path / "none")], check=True,
                   cwd=str(outside), env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert _manifest_versions(tmp_path / "none")["git_commit"] is None


def test_construction_does_not_wait_for_git_and_close_ends_it(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "_git_argv", lambda: ["sleep", "30"])
    cpu = time.process_time()
    start = time.monotonic()
    mgr = distckpt.CheckpointManager(str(tmp_path))
    assert time.monotonic() - start < 10  # the 30 s child is not waited for
    probe = mgr._session.versions_probe
    assert probe is not None and probe._child is not None
    child = probe._child
    assert child.poll() is None  # still running while the job trains
    mgr.close()
    assert child.returncode is not None  # ended and reaped by close(): no stray process
    assert time.process_time() - cpu < 5


def test_a_hung_git_holds_the_first_save_no_longer_than_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "_git_argv", lambda: ["sleep", "30"])
    monkeypatch.setattr(versions, "GIT_TIMEOUT_S", 0.5)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        child = mgr._session.versions_probe._child
        start = time.monotonic()
        mgr.save(1, {"w": torch.zeros(2)})
        assert time.monotonic() - start < 10
        assert child.returncode is not None  # killed at the deadline
    assert _manifest_versions(tmp_path)["git_commit"] is None


def test_no_git_at_all_is_an_unknown_commit_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "_git_argv", lambda: [str(tmp_path / "no-such-git")])
    with distckpt.CheckpointManager(str(tmp_path / "root")) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    found = _manifest_versions(tmp_path / "root")
    assert found["git_commit"] is None and found["torch"] == torch.__version__


def test_the_platform_reads_as_platform_platform_says_it_without_a_child_process(monkeypatch):
    expected = platform.platform()

    def no_children(*args, **kwargs):
        raise AssertionError("a child process was started")

    monkeypatch.setattr(subprocess, "Popen", no_children)
    monkeypatch.setattr(subprocess, "run", no_children)
    assert versions._platform() == expected


def test_git_runs_without_optional_locks(tmp_path, monkeypatch):
    """git must not take .git/index.lock to refresh the index: held while it runs, the user's own
    git commands failed; and a git ended by close() left the lock behind for good."""
    fake = tmp_path / "fake-git"
    fake.write_text("#!/bin/sh\n[ \"$GIT_OPTIONAL_LOCKS\" = 0 ] && echo '# branch.oid " + "ab" * 20 + "'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(versions, "_git_argv", lambda: [str(fake)])
    with distckpt.CheckpointManager(str(tmp_path / "root")) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    assert _manifest_versions(tmp_path / "root")["git_commit"] == "ab" * 20


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="no git")
def test_the_real_git_never_writes_into_the_users_repository(tmp_path):
    """`git describe --dirty` took .git/index.lock to refresh the index whatever
    GIT_OPTIONAL_LOCKS said (git 2.39): a job killed while it ran left the user's repository
    locked. Nothing is created in .git now (its modification time stays), also with a
    tracked file touched since the index was written (what makes git want to refresh)."""
    import time

    repo, head = _committed_repo(tmp_path)
    time.sleep(0.05)
    os.utime(repo / "train.py")  # stat changed, content not: a refresh would rewrite the index
    before = os.stat(repo / ".git").st_mtime_ns, os.stat(repo / ".git" / "index").st_mtime_ns
    subprocess.run([sys.executable, str(repo / "train.py"), str(tmp_path / "root")], check=True, cwd=str(tmp_path))
    assert _manifest_versions(tmp_path / "root")["git_commit"] == head
    assert (os.stat(repo / ".git").st_mtime_ns, os.stat(repo / ".git" / "index").st_mtime_ns) == before


def test_a_manager_dropped_without_close_leaves_no_child_or_file_to_warn_about(tmp_path):
    """A manager never closed nor saved with: its git child and output file were reaped at exit
    with ResourceWarnings ("subprocess ... is still running", "unclosed file")."""
    script = ("import gc, tempfile, time, warnings\n"
              "import distckpt\n"
              "with warnings.catch_warnings(record=True) as caught:\n"
              "    warnings.simplefilter('always')\n"
              f"    mgr = distckpt.CheckpointManager({str(tmp_path / 'c')!r})\n"
              "    time.sleep(0.3)\n"
              "    del mgr\n"
              "    gc.collect()\n"
              "print([str(w.message) for w in caught if issubclass(w.category, ResourceWarning)])\n")
    out = subprocess.run([sys.executable, "-X", "dev", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

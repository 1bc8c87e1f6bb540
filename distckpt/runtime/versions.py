"""The environment a checkpoint was written in: costs bytes, saves guessing later."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import numpy as np
import torch

GIT_TIMEOUT_S = 5.0  # a slow or hung git (a network file system) must not hold up a save longer


class VersionsProbe:
    """The environment, its slow part started early and read when the first manifest is written.

    `git` runs as a child process started here (rank 0's manager construction) and read at the
    first save: its ~5-9 ms (more in a large work tree) ran on the training thread at every
    process's first save, and `platform.platform()` ran `uname -p` in another child (~5 ms).
    The child's output goes to an unnamed file, not a pipe: a DataLoader worker forked while the
    child runs inherits the descriptor, and a pipe would then not reach end-of-file until that
    worker exited (a save once waited on such a pipe with no deadline)."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._output: IO[bytes] | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._collected: dict[str, str | None] | None = None
        try:
            self._output = tempfile.TemporaryFile()
            # GIT_OPTIONAL_LOCKS=0: git must not refresh the index (its lock, index.lock, held
            # while it runs, made the user's own git commands fail, and a git ended by close()
            # left the lock behind for good)
            self._child = subprocess.Popen(_git_argv(), stdin=subprocess.DEVNULL, stdout=self._output,
                                           stderr=subprocess.DEVNULL, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
        except (OSError, subprocess.SubprocessError):  # no git installed: the commit is unknown
            self.close()

    def collect(self) -> dict[str, str | None]:
        """Every value a string or None, as the manifest's schema wants; computed once."""
        if self._collected is None:
            self._collected = _environment(self._git_commit())
        return self._collected

    def _git_commit(self) -> str | None:
        if self._child is None or self._output is None:
            return None
        try:
            self._child.wait(timeout=max(0.0, GIT_TIMEOUT_S - (time.monotonic() - self._started)))
        except subprocess.TimeoutExpired:
            self.close()
            return None
        self._output.seek(0)
        out = self._output.read().decode(errors="replace")
        ok = self._child.returncode == 0
        self.close()
        return _commit_of_status(out) if ok else None

    def __del__(self) -> None:
        # A manager dropped without close() or a save: its child, never waited for, was reaped
        # at exit with a ResourceWarning ("subprocess ... is still running").
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn subprocess down
            pass

    def close(self) -> None:
        """Ends the child if it still runs (a manager closed before its first save)."""
        child, self._child = self._child, None
        if child is not None and child.poll() is None:
            child.terminate()  # git removes any lock file of its own on SIGTERM
            try:
                child.wait(timeout=1)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        output, self._output = self._output, None
        if output is not None:
            output.close()


def collect_versions() -> dict[str, str | None]:
    """The environment now, git included (for callers without a manager: imports)."""
    return VersionsProbe().collect()


def _environment(git_commit: str | None) -> dict[str, str | None]:
    """cuDNN's version is an int on GPU builds: taken as it came, it failed every save on a GPU
    machine; hence every value made a string."""
    from distckpt import __version__

    found: dict[str, Any] = {
        "distckpt": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": _platform(),
        "git_commit": git_commit,
    }
    return {name: None if value is None else str(value) for name, value in found.items()}


def _platform() -> str:
    """platform.platform()'s text without its processor lookup, which runs `uname -p` in a child
    process (~5 ms per process): "Linux-6.1.0-x86_64-with-glibc2.36"."""
    system, _, release, _, machine = os.uname()
    libc, version = platform.libc_ver()
    return "-".join(part for part in (system, release, machine, f"with-{libc}{version}" if libc else "") if part)


def _git_argv() -> list[str]:
    """One call for the commit and its dirtiness (tracked files only). `git status` honours
    GIT_OPTIONAL_LOCKS=0; `git describe --dirty` (git 2.39) took .git/index.lock to refresh the
    index anyway, and a job killed while it ran (a pre-emption kills the process group) left
    the user's repository locked: their next `git commit` failed until the lock was removed."""
    return ["git", "-C", _training_code_dir(), "status", "--porcelain=v2", "--branch", "--untracked-files=no"]


def _commit_of_status(out: str) -> str | None:
    """`# branch.oid <commit>` ("(initial)" before the first commit), then one line per changed
    tracked file: the commit, `-dirty` after it when any changed, as `git describe --dirty`
    spells it."""
    lines = out.splitlines()
    commit = next((line.split()[2] for line in lines if line.startswith("# branch.oid ") and len(line.split()) == 3),
                  None)
    if commit is None or not re.fullmatch(r"[0-9a-f]{40,64}", commit):
        return None
    return commit + ("-dirty" if any(line and not line.startswith("#") for line in lines) else "")


def _training_code_dir() -> str:
    """The directory of the main script (the training code), where it is a file; else the cwd."""
    main = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else os.getcwd()
    return os.path.dirname(main) if os.path.isfile(main) else os.getcwd()

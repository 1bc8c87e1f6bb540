"""The code before, for a bench's "before" rows: a checkout of an earlier commit of this
repository under build/ (git worktree), or a checkout the user names, or none."""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def baseline_checkout(arg: str | None, commit: str, name: str) -> tuple[str | None, str]:
    """The root of the code before (its distckpt package inside), or None, and what it is:
    `arg` a checkout's path, "none", or None for `commit` checked out at build/NAME-COMMIT."""
    if arg == "none":
        return None, "before rows skipped (--baseline none)"
    if arg:
        if not os.path.isfile(os.path.join(arg, "distckpt", "__init__.py")):
            raise SystemExit(f"--baseline {arg}: no distckpt/__init__.py there")
        return os.path.abspath(arg), f"before: {os.path.abspath(arg)}"
    path = os.path.join(ROOT, "build", f"{name}-{commit}")
    shown = os.path.relpath(path, ROOT)
    if os.path.isfile(os.path.join(path, "distckpt", "__init__.py")):
        return path, f"before: {commit} ({shown})"
    has = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{commit}^{{commit}}"],
                         capture_output=True).returncode == 0
    if not has:
        return None, (f"before rows skipped: commit {commit} is not in this repository's history "
                      "(pass --baseline PATH to a checkout of the code before)")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit], check=True, capture_output=True)
    return path, f"before: {commit} ({shown}, made with git worktree add)"

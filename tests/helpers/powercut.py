"""A power cut at any instant, modelled on POSIX durability rules (as in SQLite's and
ALICE's crash tests): after the cut, a file holds what was fsynced and a directory lists
what it listed at its last fsync. Data never fsynced is torn (zeros); a rename or link whose
directory was never fsynced afterwards is lost; an unlink likewise comes back.

Usage: `cut = PowerCut(root, at=k)` patches os/shutil in this process so that the k-th
durability-relevant operation (fsync, rename, link, unlink, rmtree, mkdir) raises PowerCutNow
before it happens; `cut.image(out)` writes the disk as it would be found after the cut.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any


class PowerCutNow(BaseException):
    """The power went out (a BaseException: nothing in the library may handle it)."""


class PowerCut:
    def __init__(self, root: str, at: int | None = None) -> None:
        self.root = os.path.abspath(root)
        self.at = at
        self.ops = 0
        self.crashed = False
        self.dirs: dict[str, dict[str, tuple[str, int]]] = {}  # durable listing of each directory
        self.content: dict[int, bytes] = {}  # inode -> durable bytes
        for d, _, files in os.walk(self.root):  # what exists now is durable
            self.dirs[d] = self._listing(d)
            for f in files:
                p = os.path.join(d, f)
                self.content[os.stat(p).st_ino] = open(p, "rb").read()
        self._real: dict[tuple[Any, str], Any] = {}

    # -- the patched operations ------------------------------------------------------------

    def __enter__(self) -> "PowerCut":
        for mod, name in ((os, "fsync"), (os, "replace"), (os, "rename"), (os, "link"), (os, "unlink"),
                          (os, "remove"), (os, "makedirs"), (shutil, "rmtree")):
            self._real[(mod, name)] = getattr(mod, name)
            setattr(mod, name, self._wrap(name, getattr(mod, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (mod, name), fn in self._real.items():
            setattr(mod, name, fn)

    def _wrap(self, name: str, real: Any) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            if self.crashed:
                return real(*args, **kwargs)  # after the cut: nothing reaches the durable image
            self.ops += 1
            if self.at is not None and self.ops >= self.at:
                self.crashed = True
                raise PowerCutNow(f"power cut before operation {self.ops}: {name}{args[:2]}")
            result = real(*args, **kwargs)
            if name == "fsync":
                self._record_fsync(args[0])
            return result
        return op

    def _record_fsync(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            self.dirs[path] = self._listing(path)
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                self.content[st.st_ino] = f.read()

    @staticmethod
    def _listing(d: str) -> dict[str, tuple[str, int]]:
        out = {}
        for name in os.listdir(d):
            st = os.lstat(os.path.join(d, name))
            out[name] = ("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino)
        return out

    # -- after the cut --------------------------------------------------------------------

    def image(self, out: str) -> None:
        """Write the disk as found after the cut into `out`."""
        self._materialise(self.root, out)

    def _materialise(self, d: str, out: str) -> None:
        os.makedirs(out)
        for name, (kind, ino) in self.dirs.get(d, {}).items():  # never fsynced since created: empty
            if kind == "dir":
                self._materialise(os.path.join(d, name), os.path.join(out, name))
            else:
                data = self.content.get(ino, b"\0" * 512)  # never fsynced: torn
                with open(os.path.join(out, name), "wb") as f:
                    f.write(data)

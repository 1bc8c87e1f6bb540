"""Gates: the type checker and the linter are clean, and the layering holds transitively."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import distckpt

PKG = os.path.dirname(distckpt.__file__)
ROOT = os.path.dirname(PKG)
# What a leaf may use of torch.distributed: tensor types and the local state-dict helpers, which
# run no collective. The process-group API (torch.distributed itself, c10d) it may not.
LOCAL_ONLY = ("torch.distributed.tensor", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp")
# Storage, format and capture modules: never the collectives, never the protocol layers above.
LEAVES = ["capture", "rng", "serialize", "manifest", "storage/__init__", "storage/local", "storage/fsspec_fs",
          "storage/s3", "errors", "async_writer", "workers", "config", "faults", "versions", "validation",
          "undo", "commit", "fencing", "retention", "inspection", "sharded", "incremental", "snapshot", "kinds",
          "storage/capabilities", "storage/conditional", "staging", "checksums", "copying", "gcpause", "interrupts",
          "reading"]
ABOVE = {"manager", "protocol", "saving", "loading", "coord", "cli", "dist", "preemption"}


def _module_imports(name: str) -> tuple[set[str], set[str]]:
    """(distckpt modules, external modules) that module `name` imports anywhere in its body."""
    path = os.path.join(PKG, f"{name}.py")
    package = name.split("/")[:-1]
    internal, external = set(), set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            external |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            external.add(node.module or "")
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            targets = [node.module] if node.module else [a.name for a in node.names]
            for target in targets:
                parts = base + target.split(".")
                candidate = "/".join(parts)
                internal.add(candidate if os.path.exists(os.path.join(PKG, f"{candidate}.py")) else f"{candidate}/__init__")
    return {m for m in internal if os.path.exists(os.path.join(PKG, f"{m}.py"))}, external


def _closure(name: str) -> tuple[set[str], set[str]]:
    seen, external, todo = set(), set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        inner, outer = _module_imports(current)
        external |= outer
        todo += sorted(inner - seen)
    return seen, external


def test_leaves_never_reach_the_collectives_or_the_layers_above_even_through_another_module():
    for leaf in LEAVES:
        modules, external = _closure(leaf)
        collectives = {m for m in external if m.startswith("torch.distributed") and not m.startswith(LOCAL_ONLY)}
        assert not collectives, f"{leaf} reaches {collectives} through {sorted(modules)}"
        assert not modules & ABOVE, f"{leaf} reaches {sorted(modules & ABOVE)}"


def test_coordination_never_imports_storage_or_the_format():
    modules, _ = _closure("coord")
    assert not modules & {"storage/__init__", "storage/local", "storage/s3", "manifest", "serialize", "commit"}


def test_every_fault_point_the_protocol_names_is_listed():
    from distckpt.runtime import faults
    named = set()
    for name in ("saving", "loading", "manager", "commit", "sharded"):
        for node in ast.walk(ast.parse(open(os.path.join(PKG, f"{name}.py")).read())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "point" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                named.add(node.args[0].value)
    assert named and named <= set(faults.POINTS), sorted(named - set(faults.POINTS))


def test_mypy_is_clean():
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:]


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "distckpt", "tests", "launch"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]

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
LEAVES = ["state/capture", "state/rng", "io/serialize", "io/manifest", "storage/__init__", "storage/local",
          "storage/fsspec_fs", "storage/s3", "errors", "protocol/async_writer", "state/workers", "config",
          "runtime/faults", "runtime/versions", "state/validation", "state/undo", "protocol/commit",
          "protocol/fencing", "protocol/retention", "tools/inspection", "state/sharded", "protocol/incremental",
          "protocol/snapshot", "state/kinds", "storage/conditional", "io/staging", "io/checksums",
          "io/copying", "runtime/gcpause", "runtime/interrupts", "io/reading"]
ABOVE = {"manager", "protocol/saving", "protocol/loading", "protocol/coord", "tools/cli",
         "runtime/dist", "runtime/preemption"}


def _module_file(dotted: str) -> str | None:
    """'distckpt.io.serialize' -> 'io/serialize' (a module) or 'io/__init__' (a package); None
    outside the package or where nothing exists."""
    parts = dotted.split(".")
    if parts[0] != "distckpt":
        return None
    rel = "/".join(parts[1:]) or "__init__"
    if os.path.exists(os.path.join(PKG, f"{rel}.py")):
        return rel
    if os.path.exists(os.path.join(PKG, rel, "__init__.py")):
        return f"{rel}/__init__" if rel != "__init__" else rel
    return None


def _module_imports(name: str) -> tuple[set[str], set[str]]:
    """(distckpt modules, external modules) that module `name` imports anywhere in its body."""
    path = os.path.join(PKG, f"{name}.py")
    if not os.path.exists(path):
        path = os.path.join(PKG, name, "__init__.py")
    internal, external = set(), set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                external.add(alias.name)
                internal.add(_module_file(alias.name) or "")
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: relative import"
            module = node.module or ""
            external.add(module)
            internal.add(_module_file(module) or "")
            for alias in node.names:  # `from distckpt.io import serialize`: the module itself
                internal.add(_module_file(f"{module}.{alias.name}") or "")
    # The package's __init__ loads names lazily (its imports are for type checkers only).
    return {m for m in internal if m and m != "__init__"}, {m for m in external if not m.startswith("distckpt")}


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
    modules, _ = _closure("protocol/coord")
    assert modules and not {m for m in modules if m.startswith(("storage/", "io/", "protocol/commit"))}, sorted(modules)


def test_every_fault_point_the_protocol_names_is_listed():
    from distckpt.runtime import faults
    named = set()
    for folder, _, files in os.walk(PKG):
        for node in (n for f in files if f.endswith(".py") for n in ast.walk(ast.parse(open(os.path.join(folder, f)).read()))):
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

"""The public API of DESIGN.md §4 is a contract: pin its surface, and the layering of modules."""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import torch

import distckpt


def test_public_names():
    for name in ("CheckpointManager", "Progress", "per_rank", "with_worker_rng", "init_distributed",
                 "DistCkptError"):
        assert hasattr(distckpt, name), name
    assert set(distckpt.__all__) <= set(dir(distckpt))


def test_manager_signature():
    sig = inspect.signature(distckpt.CheckpointManager)
    params = sig.parameters
    assert list(params)[0] == "url"
    for name, default in (("keep_last", None), ("keep_best", None), ("best_mode", "min"),
                          ("async_save", False), ("storage_options", None)):
        assert params[name].default == default and params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert "timeout" in params
    save = inspect.signature(distckpt.CheckpointManager.save).parameters
    assert list(save)[:3] == ["self", "step", "state"]
    assert save["epoch"].kind is save["metric"].kind is inspect.Parameter.KEYWORD_ONLY
    for method in ("load_latest", "wait", "close", "__enter__", "__exit__"):
        assert callable(getattr(distckpt.CheckpointManager, method))
    assert {"step", "epoch"} <= set(distckpt.Progress.__dataclass_fields__)


def test_errors_form_one_tree():
    for name in dir(distckpt):
        obj = getattr(distckpt, name)
        if isinstance(obj, type) and issubclass(obj, BaseException) and not issubclass(obj, Warning):
            assert issubclass(obj, distckpt.DistCkptError) and issubclass(obj, Exception), name
    assert issubclass(distckpt.StorageError, OSError)


# The rooms of the package, bottom up: a module imports only from its own room or rooms below it.
LAYERS = {"errors": 0, "config": 0, "runtime": 1, "storage": 2, "io": 3, "state": 4, "protocol": 5,
          "manager": 6, "testing": 6, "tools": 7, "integrations": 7, "__init__": 8, "__main__": 8}
# Rooms that never touch torch.distributed (pure bytes, files and formats).
NO_COLLECTIVES = {"errors", "config", "storage", "io"}


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the package imports absolutely)"
            names.add(node.module or "")
    return names


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "distckpt":
        return None
    return parts[1] if len(parts) > 1 else "errors"  # `from distckpt import errors, __version__`


def _modules():
    pkg = os.path.dirname(distckpt.__file__)
    for folder, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, pkg)
                yield rel, rel.split(os.sep)[0].removesuffix(".py")


def test_layering():
    """Dependencies point one way, bottom up through LAYERS; every module's room is known."""
    wrong = []
    for rel, room in _modules():
        assert room in LAYERS, f"{rel}: a room the layering test does not know"
        for name in _imports(os.path.join(os.path.dirname(distckpt.__file__), rel)):
            if room in NO_COLLECTIVES and name.startswith("torch.distributed"):
                wrong.append(f"{rel} imports {name}")
            other = _room(name)
            if other is not None and LAYERS[other] > LAYERS[room]:
                wrong.append(f"{rel} ({room}) imports {name} ({other})")
    assert not wrong, "\n".join(wrong)
    coord = _imports(os.path.join(os.path.dirname(distckpt.__file__), "protocol", "coord.py"))
    assert not {n for n in coord if n.startswith(("distckpt.storage", "distckpt.io"))}, "coordination never touches storage"


MAX_MODULE_LINES = 700  # a module a reader holds in mind at once; past it, it holds two ideas


def test_no_module_is_longer_than_700_lines():
    pkg = os.path.dirname(distckpt.__file__)
    long = {}
    for rel, _ in _modules():
        with open(os.path.join(pkg, rel), encoding="utf-8") as f:
            lines = len(f.read().splitlines())
        if lines > MAX_MODULE_LINES:
            long[rel] = lines
    assert long == {}, f"split these into cohesive modules of their room: {long}"


def test_import_distckpt_does_not_import_torch():
    """`import distckpt` (and the command line's --help) stays light: names load on first use."""
    import subprocess
    import sys

    code = "import sys, distckpt; assert 'torch' not in sys.modules, 'torch'; distckpt.CheckpointManager; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("workers, wrapped, warned", [(2, False, True), (2, True, False), (0, False, False)])
def test_a_loader_with_workers_over_an_unwrapped_dataset_is_warned_about_once(tmp_path, workers, wrapped, warned):
    """Workers' random streams travel only with with_worker_rng; a dataset that draws nothing
    needs no wrapper, so this is a warning (once per loader), not a refusal."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(8))
    loader = StatefulDataLoader(distckpt.with_worker_rng(data) if wrapped else data, batch_size=2, num_workers=workers)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(1, {"loader": loader})
            mgr.save(2, {"loader": loader})
    ours = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]
    assert len(ours) == (1 if warned else 0), ours
    if warned:
        assert "state['loader']" in ours[0] and "with_worker_rng" in ours[0]


@pytest.mark.parametrize("options", [{}, {"incremental": True}, {"async_save": True}], ids=["sync", "incremental", "async"])
def test_a_save_leaves_the_live_tensors_resizable(tmp_path, options):
    """Reading a tensor's bytes through .numpy() marked its storage non-resizable for good: a
    later resize_ (or a framework freeing storage with resize_(0)) failed after any save."""
    model = torch.nn.Linear(3, 2)
    plain = torch.zeros(8)
    with distckpt.CheckpointManager(str(tmp_path), **options) as mgr:
        mgr.save(1, {"model": model, "plain": plain, "vals": {"x": torch.ones(3)}})
        mgr.save(2, {"model": model, "plain": plain, "vals": {"x": torch.ones(3)}})
    for t in (plain, model.weight, model.bias):
        assert t.untyped_storage().resizable()
    plain.resize_(16)
    with torch.no_grad():
        model.weight.untyped_storage().resize_(0)  # as FSDP1 / ZeRO-3 free a parameter's memory


class _CallsTheManager:
    """A state entry whose state_dict() / load_state_dict() calls back into the manager."""

    def __init__(self, call):
        self.call, self.errors = call, []

    def _call(self):
        try:
            self.call()
        except distckpt.ConfigError as e:
            self.errors.append(str(e))

    def state_dict(self):
        self._call()
        return {"a": 1}

    def load_state_dict(self, sd):
        self._call()


@pytest.mark.parametrize("inner", ["save", "close", "wait", "load_latest", "preemption_requested"])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_manager_call_from_inside_a_save_is_refused_and_the_save_goes_on(tmp_path, inner, async_save):
    """A save() from a state_dict() committed its step, then the outer step below it; a close()
    there closed the manager under the running save (which still committed)."""
    mgr = distckpt.CheckpointManager(str(tmp_path), async_save=async_save)
    calls = {"save": lambda: mgr.save(99, {"z": 1}), "close": mgr.close, "wait": mgr.wait,
             "load_latest": lambda: mgr.load_latest({"z": 0}), "preemption_requested": mgr.preemption_requested}
    entry = _CallsTheManager(calls[inner])
    mgr.save(1, {"r": entry})
    mgr.wait()
    assert len(entry.errors) == 1 and f"{inner}() called while this CheckpointManager's save() is running on the " \
        "same thread" in entry.errors[0], entry.errors
    assert mgr.committed_steps() == [1]
    mgr.save(2, {"r": {"a": 1}})  # still open, and the next call is taken
    mgr.close()
    assert distckpt.CheckpointManager(str(tmp_path)).committed_steps() == [2, 1]


def test_a_manager_call_from_inside_a_load_is_refused_and_nothing_changes(tmp_path):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"r": _CallsTheManager(lambda: None), "w": torch.ones(2)})
        entry = _CallsTheManager(lambda: mgr.save(5, {"z": 1}))
        state = {"r": entry, "w": torch.zeros(2)}
        assert mgr.load_latest(state).step == 1
        assert entry.errors and all("save() called while this CheckpointManager's load_latest() is running" in e
                                    for e in entry.errors)  # its state_dict() (the undo copy) and load_state_dict()
        assert mgr.committed_steps() == [1] and torch.equal(state["w"], torch.ones(2))


def test_a_second_thread_s_call_while_a_save_runs_is_refused_naming_both(tmp_path):
    """Two threads' saves crossed their exchanges: 'rank 0's report names ...' or FencedError,
    some steps committed and some not."""
    import threading

    inside, release = threading.Event(), threading.Event()

    class Slow:
        def state_dict(self):
            inside.set()
            assert release.wait(30)
            return {"a": 1}

        def load_state_dict(self, sd):
            pass

    mgr = distckpt.CheckpointManager(str(tmp_path))
    first = threading.Thread(target=mgr.save, args=(1, {"s": Slow()}), name="trainer")
    first.start()
    assert inside.wait(30)
    try:
        with pytest.raises(distckpt.ConfigError, match=r"save\(\) called from thread MainThread while this "
                                                       r"CheckpointManager's save\(\) runs on another thread"):
            mgr.save(2, {"x": 1})
    finally:
        release.set()
        first.join(30)
    mgr.save(2, {"x": 1})
    assert mgr.committed_steps() == [2, 1]
    mgr.close()


def test_every_error_and_warning_the_readme_names_is_a_top_level_name():
    """`except distckpt.X` / `filterwarnings(category=distckpt.X)` written from the README works for
    each X it names (NonAtomicStorageWarning lived in distckpt.storage only)."""
    import builtins
    import os
    import re

    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")  # the README's pages
    readme = "".join(open(os.path.join(d, f)).read() for d, _, fs in os.walk(docs) for f in fs if f.endswith(".md"))
    named = set(re.findall(r"`(?:distckpt\.)?([A-Z][A-Za-z]*(?:Error|Warning))`", readme))
    builtin = {n for n in named if hasattr(builtins, n)}
    torch_or_other = {"SignalException", "CheckpointException", "ChildFailedError"}
    missing = sorted(n for n in named - builtin - torch_or_other if not hasattr(distckpt, n))
    assert len(named) > 15 and missing == [], missing

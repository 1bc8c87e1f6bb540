"""Entry kinds are a registry (distckpt/state/kinds/): callers ask a kind what it declares and
never test its name, and a kind added in one place (here: a test file) is saved, loaded,
inspected and compared by the doctor with no other file touched."""

from __future__ import annotations

import ast
import json
import os
import textwrap

import pytest
import torch

import distckpt
from distckpt.errors import ConfigError, IncompatibleCheckpointError
from distckpt.state.kinds import (
    PER_RANK,
    REPLICATED,
    Differing,
    Job,
    Kind,
    classify,
    kind_named,
    register_kind,
    registered_kinds,
    unregister_kind,
)
from distckpt.state.kinds.builtin import BUILTIN
from distckpt.testing import run_world

PACKAGE = os.path.dirname(distckpt.__file__)
KINDS_PACKAGE = os.path.join(PACKAGE, "state", "kinds")
BUILTIN_NAMES = frozenset(k.name for k in BUILTIN)

# -- no caller tests a kind's name ------------------------------------------------------------------

# An operand that mentions one of these is about an entry or its kind (`entry.kind`, `saved.get("kind")`,
# `kinds.get(key)`, `d.entry`): compared with a kind's name, it branches on the kind by name.
_ABOUT_ENTRIES = ("kind", "entry", "entries", "key")


def _names_a_kind(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in BUILTIN_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_kind(e) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple") \
            and node.args:
        return _names_a_kind(node.args[0])
    return False


def _about_entries(node: ast.AST) -> bool:
    for n in ast.walk(node):
        word = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else \
            n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else ""
        if any(w in word.lower() for w in _ABOUT_ENTRIES):
            return True
    return False


def _a_table_of_kind_names(node: ast.AST) -> bool:
    """A literal that lists kinds by name (`("value", "tensor")`, `{"sharded_module": ...}`)."""
    if isinstance(node, ast.Dict):
        keys = [k for k in node.keys if k is not None]
        return len(keys) >= 2 and all(isinstance(k, ast.Constant) and k.value in BUILTIN_NAMES for k in keys)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return len(node.elts) >= 2 and all(isinstance(e, ast.Constant) and e.value in BUILTIN_NAMES for e in node.elts)
    return False


def kind_name_branches(source: str) -> list[str]:
    """Where `source` tests a kind by its name: a comparison of an entry's or a record's kind with a
    kind name, a `case` on one, or a table of kind names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        named = [o for o in operands if _names_a_kind(o)]
        if named and any(_about_entries(o) for o in operands if o not in named):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue) \
                and _names_a_kind(node.pattern.value):
            found.append(f"line {node.pattern.lineno}: case {ast.unparse(node.pattern)}")
        elif _a_table_of_kind_names(node):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_kinds_package_tests_a_kind_by_its_name():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        if os.path.commonpath([folder, KINDS_PACKAGE]) == KINDS_PACKAGE:
            continue
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            found += [f"{os.path.relpath(path, PACKAGE)} {hit}" for hit in kind_name_branches(open(path).read())]
    assert not found, "ask the entry's kind (entry.kind_spec, kind_named(name)) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("source, branches", [
    ('if entry.kind == "loader": pass', True),
    ('x = e.kind in ("module", "sharded_module")', True),
    ('y = saved.get("kind") not in ("sharded_module", "sharded_optimizer")', True),
    ('z = any(d.entry == "sampler" for d in diffs)', True),
    ('w = kinds.get(key) == "module"', True),
    ('_HANDED_OVER = frozenset({"value", "stateful"})', True),
    ('_AS = {"sharded_module": ("module",), "sharded_optimizer": ("stateful",)}', True),
    ('match record["kind"]:\n    case "tensor":\n        pass', True),
    ('ok = r["change"] == "value"', False),  # a diff's change type, not a kind
    ('ok = "generator" in saved', False),  # a sampler's saved field
    ('extra = {"imported": source}', False),  # a manifest field
    ('ok = entry.kind_spec.holds_weights', False),
])
def test_the_check_finds_a_test_of_a_kind_by_its_name(source, branches):
    """The check above can fail: each way a caller branched on a kind's name is found."""
    assert bool(kind_name_branches(textwrap.dedent(source))) is branches


# -- the registry -------------------------------------------------------------------------------------

def test_the_built_in_kinds_are_asked_in_their_order_with_the_generic_ones_last():
    order = [type(k) for k in registered_kinds()]
    assert order[:len(BUILTIN)] == list(BUILTIN)
    generic = [k.generic for k in registered_kinds()]
    assert generic == sorted(generic), "a generic kind is asked before a specific one"
    for kind in registered_kinds():
        assert kind_named(kind.name) is kind


def test_a_name_no_kind_has_reads_as_a_kind_that_declares_nothing():
    unknown = kind_named("from_a_newer_version")
    assert unknown.name == "from_a_newer_version" and unknown.shown_as({}) == "from_a_newer_version"
    assert not unknown.holds_weights and unknown.saved_weights({"state_dict": {}}) is None
    assert kind_named(None).name == "None" and kind_named("from_a_newer_version") is unknown


class _NoName(Kind):
    pass


class _TakesModules(Kind):
    name = "module"


@pytest.mark.parametrize("cls, said", [(int, "subclass of distckpt's Kind"), (_NoName, "set `name`"),
                                       (_TakesModules, "the name 'module' is Module's")])
def test_a_kind_that_cannot_be_registered_is_refused_with_the_reason(cls, said):
    before = registered_kinds()
    with pytest.raises(ConfigError, match=said):
        register_kind(cls)
    assert registered_kinds() == before


# -- a kind of the user's, in this file only --------------------------------------------------------

class Reservoir:
    """A user's object with state of its own, and neither state_dict nor anything distckpt knows."""

    def __init__(self, seen: int = 0) -> None:
        self.items = list(range(seen % 5))
        self.seen = seen

    def get_state(self) -> dict:
        return {"items": list(self.items), "seen": self.seen}

    def set_state(self, state: dict) -> None:
        self.items, self.seen = list(state["items"]), state["seen"]


class ReservoirKind(Kind):
    """A reservoir sampler: its items and count, each rank its own."""

    name = "test_reservoir"
    description = "a reservoir: its items and count"
    scope = PER_RANK

    def matches(self, key, obj):
        return isinstance(obj, Reservoir)

    def capture(self, entry):
        return entry.target.get_state()

    def validate(self, entry, saved, where, world, rules):
        if not isinstance(saved, dict) or not isinstance(saved.get("seen"), int):
            raise IncompatibleCheckpointError(f"{where}: no reservoir in the checkpoint")

    def restore(self, entry, value, state, release):
        entry.target.set_state(value)
        return []

    def undo(self, entry, state):
        saved = entry.target.get_state()
        return lambda: entry.target.set_state(saved)

    def shown_as(self, record):
        return "reservoir"

    def summary(self, state):
        return {"seen": state.get("seen")}

    def likely_causes(self, differing: list[Differing], job: Job) -> list[str]:
        return [f"`{differing[0].key}` (a reservoir) differs → its count was not restored"]


@pytest.fixture
def reservoir_kind():
    register_kind(ReservoirKind)
    yield ReservoirKind
    unregister_kind(ReservoirKind)


def test_a_kind_registered_in_one_file_is_asked_before_the_generic_ones_and_can_be_taken_out(tmp_path, reservoir_kind):
    order = registered_kinds()
    position = next(i for i, k in enumerate(order) if type(k) is ReservoirKind)
    assert all(not k.generic for k in order[:position]) and all(k.generic for k in order[position + 1:])
    (entry,) = classify({"res": Reservoir(3)})
    assert entry.kind == "test_reservoir" and entry.scope == PER_RANK and type(entry.kind_spec) is ReservoirKind
    unregister_kind(ReservoirKind)
    with pytest.raises(distckpt.UnstorableValueError):  # a value again: nothing stores the object
        with distckpt.CheckpointManager(str(tmp_path)) as mgr:
            mgr.save(0, {"res": Reservoir(3)})
    register_kind(ReservoirKind)  # for the fixture to take out


def test_a_kind_registered_before_another_is_asked_first(reservoir_kind):
    class TaggedTensorKind(Kind):
        name = "test_tagged_tensor"

        def matches(self, key, obj):
            return key == "tagged" and isinstance(obj, torch.Tensor)

    from distckpt.state.kinds.tensor import Tensor

    register_kind(TaggedTensorKind, before=Tensor)
    try:
        kinds = {e.key: e.kind for e in classify({"tagged": torch.zeros(2), "plain": torch.zeros(2)})}
        assert kinds == {"tagged": "test_tagged_tensor", "plain": "tensor"}  # not the plain-tensor short cut
    finally:
        unregister_kind(TaggedTensorKind)
    assert classify({"tagged": torch.zeros(2)})[0].kind == "tensor"


def _save_run(root: str, seen_at: list[int]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    res = Reservoir()
    with distckpt.CheckpointManager(root) as mgr:
        for step, seen in enumerate(seen_at):
            res.set_state(Reservoir(seen).get_state())
            mgr.save(step, {"model": model, "res": res})


def test_a_kind_of_the_users_is_saved_loaded_inspected_and_compared(tmp_path, reservoir_kind, capsys):
    from distckpt.tools import cli
    from distckpt.tools.doctor import compare_roots

    _save_run(str(tmp_path / "a"), [3, 7, 11])
    fresh = Reservoir()
    with distckpt.CheckpointManager(str(tmp_path / "a")) as mgr:
        progress = mgr.load_latest({"model": torch.nn.Linear(2, 1), "res": fresh})
    assert progress.step == 2 and fresh.get_state() == Reservoir(11).get_state()

    assert cli.main(["inspect", str(tmp_path / "a"), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["manifest"]["entries"]["res"] == {"kind": "test_reservoir", "scope": "per_rank"}
    assert described["ranks"][0]["entries"]["res"] == {"kind": "test_reservoir", "seen": 11}

    _save_run(str(tmp_path / "b"), [3, 8, 11])
    report = compare_roots(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.first_step == 1 and {d.entry for d in report.differences} == {"res"}, report.differences
    assert report.entry_kinds == {"model": "module", "res": "reservoir"}
    assert report.causes == ["`res` (a reservoir) differs → its count was not restored"], report.causes


def test_a_checkpoint_of_a_kind_this_process_does_not_know_is_still_inspected(tmp_path, capsys):
    from distckpt.tools import cli

    register_kind(ReservoirKind)
    try:
        _save_run(str(tmp_path / "a"), [4])
    finally:
        unregister_kind(ReservoirKind)
    assert cli.main(["inspect", str(tmp_path / "a"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["entries"]["res"] == {"kind": "test_reservoir"}
    with distckpt.CheckpointManager(str(tmp_path / "a")) as mgr:  # restored as a value: its kind differs
        with pytest.raises(IncompatibleCheckpointError, match="test_reservoir entry in the checkpoint") as refused:
            mgr.load_latest({"model": torch.nn.Linear(2, 1), "res": {"items": [], "seen": 0}})
    # the likely cause and its fix: the module registering the kind was not imported here
    said = str(refused.value)
    assert "kind 'test_reservoir' is not registered in this process" in said and "register_kind" in said, said


def test_a_kind_mismatch_between_registered_kinds_names_no_registration(tmp_path, reservoir_kind):
    """The registration hint is only for a kind this process does not know: a saved value loaded
    into a reservoir is a mismatch of two known kinds."""
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(0, {"res": {"items": [], "seen": 0}})
        with pytest.raises(IncompatibleCheckpointError, match="value entry in the checkpoint") as refused:
            mgr.load_latest({"res": Reservoir(3)})
    assert "not registered" not in str(refused.value)


def test_every_built_in_kind_says_what_it_holds():
    for kind in BUILTIN:
        assert kind.description, f"{kind.__name__}: say in `description` what it holds"


# -- a replicated kind of the user's is compared across ranks -------------------------------------

class Counter:
    """A user's object every rank is meant to hold equal (a curriculum step): no state_dict."""

    def __init__(self, count: int) -> None:
        self.count = count


class CounterKind(Kind):
    """Left at the default scope (replicated): written once, from rank 0."""

    name = "test_counter"
    description = "a counter every rank holds equal"

    def matches(self, key, obj):
        return isinstance(obj, Counter)

    def capture(self, entry):
        return {"count": entry.target.count}

    def restore(self, entry, value, state, release):
        entry.target.count = value["count"]
        return []


def _save_and_load_counters(rank: int, world: int, url: str, counts: list[int]) -> dict:
    register_kind(CounterKind)
    with distckpt.CheckpointManager(url) as mgr:
        try:
            mgr.save(1, {"counter": Counter(counts[rank])})
        except distckpt.UnstorableValueError as e:
            return {"refused": str(e)}
        fresh = Counter(-1)
        mgr.load_latest({"counter": fresh})
        return {"loaded": fresh.count}


@pytest.mark.parametrize("counts", [[5, 5], [5, 6], [0, 1]])
def test_a_replicated_kind_of_the_users_that_differs_between_two_ranks_is_refused_at_save(tmp_path, counts):
    """Two gloo ranks: rank 0's copy alone is written, so a difference is refused on every rank,
    naming the entry; equal copies are saved and every rank loads them."""
    results = run_world("test_kinds:_save_and_load_counters", 2, url=str(tmp_path), counts=counts)
    assert all(r.error is None for r in results), [r.error for r in results]
    if len(set(counts)) == 1:
        assert [r.value for r in results] == [{"loaded": counts[0]}] * 2
        return
    said = {r.value.get("refused") for r in results}
    assert len(said) == 1 and None not in said, said
    message = said.pop()
    assert "state['counter'] differs on rank(s) [1] from rank 0's" in message and "per_rank" in message, message
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.committed_steps() == []  # nothing of the refused save is committed


class _NotCompared(CounterKind):
    name = "test_not_compared"
    compared_across_ranks = False


class _NotComparedWithReason(_NotCompared):
    name = "test_not_compared_with_reason"
    not_compared_because = "each rank checks it against its own on load"


def test_a_replicated_kind_that_is_not_compared_must_say_why():
    with pytest.raises(ConfigError, match="not_compared_because"):
        register_kind(_NotCompared)
    assert all(type(k) is not _NotCompared for k in registered_kinds())
    register_kind(_NotComparedWithReason)
    unregister_kind(_NotComparedWithReason)


def test_every_replicated_built_in_kind_is_compared_or_says_why():
    for kind in BUILTIN:
        if kind.scope == REPLICATED:
            assert kind.compared_across_ranks or kind.not_compared_because, kind.__name__

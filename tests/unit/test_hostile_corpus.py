"""A generated corpus of hostile metadata: manifests, markers, leases and safetensors headers with
fields mutated to other types, ranges or shapes, re-signed so that only the structure is wrong.
Each is refused fast and small with a distckpt error (never a raw KeyError/TypeError, never a
large allocation), or loads identically."""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import time
import warnings
from typing import Callable

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.io.manifest import _marker_sum
from distckpt.tools import cli

EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "15"))
hostile_values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([10**8, 2**63, 2**64, -1, 0]),
    st.floats(allow_nan=True), st.text(max_size=12), st.lists(st.integers(0, 2**64), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _step_dir(root: str) -> str:
    return os.path.join(root, "step-000000001")


def _build(root: str) -> dict:
    state = {"w": torch.arange(6.0), "cfg": {"lr": 0.1, "names": ["a", "b"]}}
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load_latest({"w": torch.zeros(6), "cfg": {}})
        mgr.save(1, state)
    return state


def _resign_manifest(step_dir: str, manifest: dict | bytes) -> None:
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest, indent=1, sort_keys=True).encode()
    with open(os.path.join(step_dir, "manifest.json"), "wb") as f:
        f.write(raw)
    marker = json.load(open(os.path.join(step_dir, "COMMITTED")))
    marker["manifest_xxh3_64"] = _digest(raw)
    # the marker's own checksum too: left stale, every mutated manifest was refused for the
    # marker's sake and the manifest's own checks were never reached
    marker.pop("marker_xxh3_64", None)
    marker["marker_xxh3_64"] = _marker_sum(marker)
    with open(os.path.join(step_dir, "COMMITTED"), "w") as f:
        json.dump(marker, f)


def _mutate_json(obj, path, value, delete):
    *parents, last = path
    for p in parents:
        obj = obj[p]
    if delete:
        del obj[last]
    else:
        obj[last] = value


def _mutate_some_field(data, doc) -> None:
    """Draw one field of `doc` (at any depth) and give it a hostile value, or delete it."""
    path = data.draw(st.sampled_from(_paths(doc)))
    _mutate_json(doc, path, data.draw(hostile_values), delete=data.draw(st.booleans()))


def _paths(obj, prefix=()):
    """Every (path) to a field of a JSON object, depth-first."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _load_is_refused_or_identical(root: str, original: dict) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()  # CPU seconds: other work on the machine does not count
    target = {"w": torch.zeros(6), "cfg": {}}
    try:
        with distckpt.CheckpointManager(root) as mgr:
            progress = mgr.load_latest(target)
        if progress is not None:  # loaded: it must be the very state that was saved
            assert torch.equal(target["w"], original["w"])
    except distckpt.DistCkptError:
        pass  # refused with one of ours: never a raw KeyError/TypeError/MemoryError
    assert time.process_time() - start < 5
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 300 * 1024, f"the load grew the peak RSS by {grown_kib} KiB"
    for command in (["inspect", root, "--json"], ["verify", root, "--json"], ["ls", root, "--json"]):
        assert cli.main(command) in (0, 1, 2)


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_a_mutated_manifest_is_refused_or_loads_identically(tmp_path_factory, data):
    root = str(tmp_path_factory.mktemp("m"))
    original = _build(root)
    step_dir = _step_dir(root)
    manifest = json.load(open(os.path.join(step_dir, "manifest.json")))
    _mutate_some_field(data, manifest)
    _resign_manifest(step_dir, manifest)
    _load_is_refused_or_identical(root, original)


@SETTINGS
@given(data=st.data())
def test_a_mutated_marker_lease_or_commit_record_is_refused_or_loads_identically(tmp_path_factory, data):
    root = str(tmp_path_factory.mktemp("k"))
    original = _build(root)
    fence = os.path.join(root, "fence")
    lease = os.path.join(fence, min(n for n in os.listdir(fence) if n.startswith("gen-")))
    record = os.path.join(fence, min(n for n in os.listdir(fence) if n.startswith("committed-gen-")))
    which = data.draw(st.sampled_from([os.path.join(_step_dir(root), "COMMITTED"), lease, record]))
    doc = json.load(open(which))
    _mutate_some_field(data, doc)
    with open(which, "w") as f:
        json.dump(doc, f)
    _load_is_refused_or_identical(root, original)


@SETTINGS
@given(data=st.data())
def test_a_mutated_safetensors_header_is_refused_or_loads_identically(tmp_path_factory, data):
    root = str(tmp_path_factory.mktemp("h"))
    original = _build(root)
    _rewrite_header(_step_dir(root), data, lambda header: _mutate_some_field(data, header))
    _load_is_refused_or_identical(root, original)


def _rewrite_header(step_dir: str, data, change) -> None:
    """Draw a payload file, `change` its safetensors header (a JSON object) in place, re-sign."""
    manifest = json.load(open(os.path.join(step_dir, "manifest.json")))
    name = data.draw(st.sampled_from(sorted(manifest["files"])))
    blob = open(os.path.join(step_dir, name), "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    new = struct.pack("<Q", len(raw)) + raw + blob[8 + n:]
    with open(os.path.join(step_dir, name), "wb") as f:
        f.write(new)
    manifest["files"][name] = {"size": len(new), "xxh3_64": _digest(new)}
    _resign_manifest(step_dir, manifest)


@pytest.mark.parametrize("name", ["COMMITTED", "manifest.json"])
def test_a_huge_metadata_file_is_not_read_whole(tmp_path, name):
    root = str(tmp_path)
    original = _build(root)
    with open(os.path.join(_step_dir(root), name), "r+b") as f:
        f.truncate((2 << 30) if name == "manifest.json" else 1 << 20)  # sparse: costs no disk
    _load_is_refused_or_identical(root, original)


def test_a_world_size_of_a_hundred_million_is_refused_before_any_allocation(tmp_path):
    root = str(tmp_path)
    original = _build(root)
    manifest = json.load(open(os.path.join(_step_dir(root), "manifest.json")))
    manifest["world_size"] = 10**8
    _resign_manifest(_step_dir(root), manifest)
    with distckpt.CheckpointManager(root, world_size_policy="reshard") as mgr:
        with pytest.raises(distckpt.CorruptCheckpointError, match="world_size"):
            mgr.load_latest({"w": torch.zeros(6), "cfg": {}})
    _load_is_refused_or_identical(root, original)


def test_a_directory_symlink_planted_in_a_step_is_not_followed(tmp_path):
    root = str(tmp_path / "c")
    original = _build(root)
    elsewhere = tmp_path / "elsewhere"
    os.rename(os.path.join(_step_dir(root), "replicated"), elsewhere)
    os.symlink(elsewhere, os.path.join(_step_dir(root), "replicated"))
    with distckpt.CheckpointManager(root) as mgr:
        with pytest.raises(distckpt.CorruptCheckpointError, match="verifies"), \
                pytest.warns(distckpt.CheckpointFallbackWarning, match="symbolic link"):
            mgr.load_latest({"w": torch.zeros(6), "cfg": {}})
    _load_is_refused_or_identical(root, original)


def _valid_manifest() -> "distckpt.io.manifest.Manifest":
    from distckpt.io import manifest as mf
    return mf.Manifest(step=7, world_size=2, run_id="run", created_unix=1.7e9, epoch=1, metric=0.5, generation=3,
                       files={mf.replicated_file(3): {"size": 10, "xxh3_64": "ab"},
                              mf.rank_file(0, 3): {"size": 1, "xxh3_64": "cd"},
                              mf.rank_file(1, 3): {"size": 1, "xxh3_64": "ef"}},
                       entries={"model": {"kind": "module", "scope": "replicated"}}, versions={"torch": "2"},
                       ranks=[{"rank": r, "step": 7, "epoch": 1, "host": "h"} for r in range(2)], payload_bytes=10)


@settings(max_examples=EXAMPLES * 8, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_manifest_that_saves_also_loads(data):
    """The writer and the reader share one schema: any field value either is refused when the
    manifest is written (UnstorableValueError) or reads back as the same manifest."""
    import dataclasses

    from distckpt.io import manifest as mf
    base = _valid_manifest()
    names = data.draw(st.lists(st.sampled_from([f.name for f in dataclasses.fields(mf.Manifest)]),
                               min_size=1, max_size=3, unique=True))
    changed = dataclasses.replace(base, **{n: data.draw(hostile_values, label=n) for n in names})
    try:
        raw = changed.to_bytes()
    except distckpt.UnstorableValueError:
        return
    marker = mf.Marker(changed.step, mf.checksum_of(raw), "run", changed.generation)
    assert mf.Manifest.parse(raw, marker, "generated") == changed


def test_a_save_whose_manifest_would_not_load_is_refused_and_names_the_field():
    import dataclasses

    from distckpt.io import manifest as mf
    with pytest.raises(distckpt.UnstorableValueError, match="'created_unix'"):
        dataclasses.replace(_valid_manifest(), created_unix=float("inf")).to_bytes()
    with pytest.raises(distckpt.UnstorableValueError, match="not storable as JSON"):
        dataclasses.replace(_valid_manifest(), sharded={"t": float("nan")}).to_bytes()
    with pytest.raises(distckpt.UnstorableValueError, match="world_size"):
        dataclasses.replace(_valid_manifest(), world_size=5).to_bytes()
    assert mf.Manifest.parse(_valid_manifest().to_bytes(), mf.Marker(7, mf.checksum_of(_valid_manifest().to_bytes()),
                                                                     "run", 3), "ok") == _valid_manifest()


def _rich_state(seed: int) -> dict:
    """One entry of most kinds: module, optimizer, scheduler, generators, a sampler, values."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 2),
            "gen": torch.Generator().manual_seed(seed), "py": random.Random(seed),
            "np": np.random.default_rng(seed), "sampler": torch.utils.data.RandomSampler(range(8)),
            "cfg": {"lr": 0.1}, "w": torch.arange(6.0)}


@SETTINGS
@given(data=st.data(), rich=st.booleans())
def test_a_mutated_tree_inside_a_payload_is_refused_or_loads_identically(tmp_path_factory, data, rich):
    """The tree a payload file carries (entries, rank, epoch, RNG streams, each kind's state),
    mutated at any depth and re-signed: refused with a distckpt error, never a raw
    KeyError/TypeError from the checks or the restore; or loaded as saved."""
    from distckpt.io.safetensors_format import TREE_METADATA_KEY

    root = str(tmp_path_factory.mktemp("t"))
    if rich:
        saved = _rich_state(0)
        with distckpt.CheckpointManager(root) as mgr:
            mgr.save(1, saved)
    else:
        original = _build(root)
    def change_tree(header: dict) -> None:
        tree = json.loads(header["__metadata__"][TREE_METADATA_KEY])
        _mutate_some_field(data, tree)
        header["__metadata__"][TREE_METADATA_KEY] = json.dumps(tree)

    _rewrite_header(_step_dir(root), data, change_tree)
    if not rich:
        _load_is_refused_or_identical(root, original)
        return
    target = _rich_state(1)
    try:
        with distckpt.CheckpointManager(root) as mgr:
            loaded = mgr.load_latest(target)
    except distckpt.DistCkptError:
        return  # refused with one of ours
    assert loaded is not None
    for a, b in zip(saved["model"].state_dict().values(), target["model"].state_dict().values()):
        assert torch.equal(a, b)


# -- something other than a regular file where a checkpoint file goes --------------------------
#
# A FIFO planted where a payload file, the manifest, the marker, a rank or shard file, a lease or
# the commit record goes made load_latest, load_weights and the command line wait in open() for a
# writer, forever; a device node reads without end; a directory or a link is no file either. Each
# is damage: the step it belongs to is skipped (the load falls back, with a warning naming it),
# the tools say the step is damaged, and nothing waits. Every kind x every file role x every
# reader; each case runs under a timeout, so a hang fails it.

def _fifo(path: str, elsewhere: str) -> None:
    os.mkfifo(path)


def _socket(path: str, elsewhere: str) -> None:
    import socket

    here = os.getcwd()
    os.chdir(os.path.dirname(path))  # bound by its relative name: a socket's path is limited to ~108 bytes
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.basename(path))
    finally:
        os.chdir(here)


def _character_device(path: str, elsewhere: str) -> None:
    import stat

    try:  # a copy of /dev/zero: read to its end, it never ends
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD (root)")


def _directory(path: str, elsewhere: str) -> None:
    os.mkdir(path)


def _link_to_fifo(path: str, elsewhere: str) -> None:
    os.mkfifo(elsewhere)
    os.symlink(elsewhere, path)


def _link_to_directory(path: str, elsewhere: str) -> None:
    os.mkdir(elsewhere)
    os.symlink(elsewhere, path)


NOT_FILES = {"fifo": _fifo, "socket": _socket, "character-device": _character_device, "directory": _directory,
             "link-to-fifo": _link_to_fifo, "link-to-directory": _link_to_directory}


def _first(directory: str, prefix: str = "") -> str:
    return os.path.join(directory, min(n for n in os.listdir(directory) if n.startswith(prefix)))


def _in_step(step: int, *parts: str) -> Callable[[str], str]:
    return lambda root: os.path.join(root, f"step-{step:09d}", *parts)


# role -> (the checkpoint it is planted in, where the file lies, the steps its damage makes unloadable)
ROLES: dict[str, tuple[str, Callable[[str], str], set[int]]] = {
    "replicated": ("single", lambda r: _first(_in_step(2, "replicated")(r)), {2}),
    "rank": ("single", lambda r: _first(_in_step(2, "ranks")(r)), {2}),
    "manifest": ("single", _in_step(2, "manifest.json"), {2}),
    "marker": ("single", _in_step(2, "COMMITTED"), {2}),
    "shard": ("split", lambda r: _first(_in_step(2, "shards")(r), "rank-00001"), {2}),
    # incremental: step 2 references the frozen tensor where step 1 wrote it
    "shared": ("incremental", lambda r: _first(_in_step(1, "replicated")(r)), {1, 2}),
    "lease": ("single", lambda r: _first(os.path.join(r, "fence"), "gen-"), set()),
    # read when no step is left: it says a commit happened, so a load does not start over
    "record": ("gone", lambda r: _first(os.path.join(r, "fence"), "committed-gen-"), set()),
}
# (reader, role) pairs where the reader never opens that file: inspect describes from headers
# and manifests, not shard files; ls reads markers and manifests, not payloads
NOT_READ = {("inspect", "shard")} | {("ls", role) for role in ("replicated", "rank", "shard", "shared")}
READERS = ("load_latest", "load_weights", "verify", "inspect", "export", "prune", "ls")


def _state_for(step: int) -> dict:
    from hostile_workers import model_for

    return {"model": model_for(step), "frozen": torch.arange(64.0)}


def _save_two_steps(root: str, **options) -> None:
    with distckpt.CheckpointManager(root, **options) as mgr:
        for step in (1, 2):
            mgr.save(step, _state_for(step))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    """Each kind of checkpoint once (steps 1 and 2); every case damages a copy."""
    import shutil

    from distckpt.testing import run_world

    base = tmp_path_factory.mktemp("layouts")
    out = {name: str(base / name) for name in ("single", "incremental", "split", "gone")}
    _save_two_steps(out["single"])
    _save_two_steps(out["incremental"], incremental=True)
    _save_two_steps(out["gone"])
    for step in (1, 2):  # every step removed (a lifecycle rule, by hand): the leases and the record stay
        shutil.rmtree(_in_step(step)(out["gone"]))
    results = run_world("hostile_workers:save_two_steps_with_split_writes", 2, url=out["split"])
    assert all(r.error is None for r in results), [r.error for r in results]
    return out


def _weights_of(step: int) -> torch.Tensor:
    return _state_for(step)["model"].weight


def _newest(layout: str, damaged: set[int]) -> int | None:
    return None if layout == "gone" else max({1, 2} - damaged, default=None)


def _expect_load_latest(root: str, layout: str, damaged: set[int], name: str) -> None:
    policy = "reshard" if layout == "split" else "refuse"  # one process reads a checkpoint of 2 ranks
    state = {"model": torch.nn.Linear(32, 8)} if layout == "split" else \
        {"model": torch.nn.Linear(32, 8), "frozen": torch.zeros(64)}
    newest = _newest(layout, damaged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(root, world_size_policy=policy) as mgr:
            if newest is None:  # nothing verifies; or every step is gone, and the record says one was committed
                with pytest.raises(distckpt.CorruptCheckpointError, match="gone" if layout == "gone" else "verifies"):
                    mgr.load_latest(state)
                return
            assert mgr.load_latest(state).step == newest
    assert torch.equal(state["model"].weight, _weights_of(newest))
    if 2 in damaged:  # the skipped step is said, naming the file that is no file
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]
        assert any("step 2" in m and name in m for m in fallbacks), fallbacks


def _expect_load_weights(root: str, layout: str, damaged: set[int]) -> None:
    newest = _newest(layout, damaged)
    module = torch.nn.Linear(32, 8)
    if newest is None:
        with pytest.raises(distckpt.DistCkptError, match="no committed checkpoint"):
            distckpt.load_weights(root, module)
        return
    assert distckpt.load_weights(root, module).step == newest
    assert torch.equal(module.weight, _weights_of(newest))


def _expect_verify(root: str, layout: str, damaged: set[int], name: str, capsys) -> None:
    code = cli.main(["verify", root, "--all"])
    out = capsys.readouterr().out
    if layout == "gone":
        assert code != 0, out
        return
    assert code == (1 if damaged else 0), out
    for step in (1, 2):
        assert (f"step {step}: BAD" if step in damaged else f"step {step}: ok") in out, out
    assert not damaged or name in out, out


def _expect_inspect(root: str, layout: str, damaged: set[int], name: str, capsys) -> None:
    newest = _newest(layout, damaged)
    code = cli.main(["inspect", root])
    captured = capsys.readouterr()
    said = captured.out + captured.err
    if newest is None:
        assert code != 0 and (layout == "gone" or name in said), captured
        return
    assert re.search(rf"^step {newest}  ", captured.out, flags=re.M), captured  # the step it describes
    assert (code != 0) == (2 in damaged), captured  # a damaged newest step is said, in the exit code too
    if 2 in damaged:
        assert "step 2" in said and name in said, captured
        assert cli.main(["inspect", root, "--step", "2"]) != 0


def _expect_export(root: str, layout: str, damaged: set[int], out_dir: str, capsys) -> None:
    newest = _newest(layout, damaged)
    code = cli.main(["export", root, out_dir])
    out = capsys.readouterr().out
    if newest is None:
        assert code != 0 and not os.path.exists(os.path.join(out_dir, "model.safetensors")), out
        return
    assert code == 0 and f"exported step {newest}:" in out, out
    module = torch.nn.Linear(32, 8)
    distckpt.load_weights(out_dir, module)
    assert torch.equal(module.weight, _weights_of(newest))
    if 2 in damaged:
        assert cli.main(["export", root, out_dir + "-2", "--step", "2"]) != 0


def _expect_prune(root: str, layout: str, damaged: set[int], name: str, capsys) -> None:
    code = cli.main(["prune", root, "--keep-last", "1"])
    out = capsys.readouterr().out
    assert code in (0, 1), out  # pruned what it may; whether damage left in place fails the command is the CLI's
    for step in sorted(damaged):
        assert f"left damaged step {step} in place" in out and name in out, out
    newest = _newest(layout, damaged)
    left = {step for step in (1, 2) if os.path.isdir(_in_step(step)(root))}
    assert left == damaged | ({newest} if newest is not None else set()), (left, out)


def _expect_ls(root: str, layout: str, damaged: set[int], name: str, capsys) -> None:
    code = cli.main(["ls", root])
    out = capsys.readouterr().out
    assert code == 0, out
    if layout == "gone":  # the record, damaged or not, says a commit happened
        assert "no committed step, but generation 1 committed one here" in out, out
    for step in sorted(damaged):
        assert re.search(rf"^\s*{step} .*damaged.*{re.escape(name)}", out, flags=re.M), out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("role", sorted(ROLES))
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_something_other_than_a_file_in_any_file_role_is_damage_and_nothing_waits(
        layouts, tmp_path, capsys, kind, role, reader):
    import shutil

    layout, where, damaged = ROLES[role]
    root = str(tmp_path / "ckpt")
    shutil.copytree(layouts[layout], root)
    path = where(root)
    os.remove(path)
    NOT_FILES[kind](path, str(tmp_path / "elsewhere"))
    name = os.path.basename(path)
    if (reader, role) in NOT_READ:
        damaged = set()
    capsys.readouterr()
    if reader == "load_latest":
        _expect_load_latest(root, layout, damaged, name)
    elif reader == "load_weights":
        _expect_load_weights(root, layout, damaged)
    elif reader == "export":
        _expect_export(root, layout, damaged, str(tmp_path / "export"), capsys)
    else:
        expect = {"verify": _expect_verify, "inspect": _expect_inspect, "prune": _expect_prune, "ls": _expect_ls}
        expect[reader](root, layout, damaged, name, capsys)


# Each source loaded in a process of its own: the safetensors library opens a file in native code
# holding the interpreter, so a FIFO's open() there could be interrupted by no timeout in this one.
_LOAD_EACH = """
import json, sys, torch, distckpt
for source in sys.argv[1:]:
    try:
        distckpt.load_weights(source, torch.nn.Linear(32, 8))
        print(json.dumps([source, None]), flush=True)
    except distckpt.DistCkptError as e:
        print(json.dumps([source, str(e)]), flush=True)
"""
HF_ROLES = ("single file", "file given", "index", "shard")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_something_other_than_a_file_in_an_exported_directory_is_refused_naming_it(tmp_path, kind):
    """load_weights from a Hugging Face file or directory: a FIFO (or any other non-file) where the
    file, its index or a shard goes is refused naming it, before it is opened (through links: a
    Hugging Face cache's files are links into its blobs)."""
    import subprocess
    import sys

    root = str(tmp_path / "ckpt")
    _save_two_steps(root)
    expected = {}
    for role in HF_ROLES:
        out = str(tmp_path / role.replace(" ", "-"))
        sharded = role in ("index", "shard")
        assert cli.main(["export", root, out] + (["--max-shard-size", "100B"] if sharded else [])) == 0
        planted = os.path.join(out, {"single file": "model.safetensors", "file given": "model.safetensors",
                                     "index": "model.safetensors.index.json", "shard": min(os.listdir(out))}[role])
        os.remove(planted)
        NOT_FILES[kind](planted, str(tmp_path / f"elsewhere-{len(expected)}"))
        # a directory given as the file is read as an exported directory: one that holds no weights
        said = "neither model.safetensors" if role == "file given" and "directory" in kind else "not a regular file"
        expected[planted if role == "file given" else out] = re.escape(planted) + ".* " + said
    done = subprocess.run([sys.executable, "-c", _LOAD_EACH, *expected], capture_output=True, text=True, timeout=240)
    results = dict(json.loads(line) for line in done.stdout.splitlines())
    assert list(results) == list(expected), done.stderr[-2000:]
    for source, pattern in expected.items():
        assert results[source] is not None and re.search(pattern, results[source]), (source, results[source])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["model.safetensors.tmp", "model.safetensors"])
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_something_other_than_a_file_where_an_export_writes_never_makes_it_wait(tmp_path, kind, name, capsys):
    """The export's temporary or final name taken by a FIFO (whose open() for writing waits for a
    reader, forever), a socket, a device or a link: replaced by the file; a directory there fails
    the export naming it, and the directory is left as it was."""
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    _save_two_steps(root)
    os.makedirs(out)
    planted = os.path.join(out, name)
    NOT_FILES[kind](planted, str(tmp_path / "elsewhere"))
    code = cli.main(["export", root, out])
    captured = capsys.readouterr()
    if kind == "directory" and name.endswith(".tmp"):  # removing a directory is not the export's to do
        assert code != 0 and planted in captured.err, captured
        assert os.path.isdir(planted) and not os.path.exists(os.path.join(out, "model.safetensors"))
        return
    if kind == "directory":  # the temporary file cannot be moved over a directory
        assert code != 0 and os.path.isdir(planted) and not os.path.exists(planted + ".tmp"), captured
        return
    assert code == 0, captured
    module = torch.nn.Linear(32, 8)
    distckpt.load_weights(out, module)
    assert torch.equal(module.weight, _weights_of(2))
    assert sorted(os.listdir(out)) == ["model.safetensors"]

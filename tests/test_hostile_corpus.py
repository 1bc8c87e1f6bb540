"""A generated corpus of hostile metadata: manifests, markers, leases and safetensors headers with
fields mutated to other types, ranges or shapes, re-signed so that only the structure is wrong.
Each is refused fast and small with a distckpt error (never a raw KeyError/TypeError, never a
large allocation), or loads identically."""

from __future__ import annotations

import json
import os
import resource
import struct
import time

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
    from distckpt.io.serialize import TREE_METADATA_KEY

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

"""Checkpoints forged from the documented layout so that every checksum verifies (sizes and
xxh3-64 in manifest.json, the manifest's digest in COMMITTED), with one saved state that the
object it belongs to would refuse. Each is found before anything is restored: the load falls back
to the intact older step (CheckpointFallbackWarning), and nothing of the forged step is applied.
Also: an optimizer of another class is refused, the live state unchanged."""

from __future__ import annotations

import glob
import json
import os
import struct
import warnings

import numpy as np
import pytest
import torch
import xxhash

import distckpt
from distckpt.io.manifest import _marker_sum


def _resign(step_dir: str) -> None:
    path = os.path.join(step_dir, "manifest.json")
    manifest = json.load(open(path))
    for rel, info in manifest["files"].items():
        blob = open(os.path.join(step_dir, rel), "rb").read()
        info["size"], info["xxh3_64"] = len(blob), xxhash.xxh3_64_hexdigest(blob)
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    open(path, "wb").write(raw)
    marker_path = os.path.join(step_dir, "COMMITTED")
    marker = json.load(open(marker_path))
    marker["manifest_xxh3_64"] = xxhash.xxh3_64_hexdigest(raw)
    marker.pop("marker_xxh3_64", None)  # and the marker's own checksum: without it the forgery
    marker["marker_xxh3_64"] = _marker_sum(marker)  # fell back as a damaged marker, proving nothing
    open(marker_path, "w").write(json.dumps(marker))


def _split(path: str) -> tuple[dict, bytes]:
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _join(path: str, header: dict, data: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + data)


def _edit_tree(path: str, change) -> None:
    header, data = _split(path)
    tree = json.loads(header["__metadata__"]["distckpt.tree"])
    change(tree)
    header["__metadata__"]["distckpt.tree"] = json.dumps(tree, separators=(",", ":"))
    _join(path, header, data)


def _fill_tensor(path: str, name: str, byte: int) -> None:
    header, data = _split(path)
    start, stop = header[name]["data_offsets"]
    data = data[:start] + bytes([byte]) * (stop - start) + data[stop:]
    _join(path, header, data)


def _get(node: dict, key: str):
    return next(v for k, v in node["d"] if k == key)


def _put(node: dict, key: str, value) -> None:
    for pair in node["d"]:
        if pair[0] == key:
            pair[1] = value


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(2, 2), "t": torch.randn(4), "nrng": np.random.default_rng(seed)}


def _rank_file(step_dir: str) -> str:
    return glob.glob(os.path.join(step_dir, "ranks", "*.safetensors"))[0]


def _replicated_file(step_dir: str) -> str:
    return glob.glob(os.path.join(step_dir, "replicated", "*.safetensors"))[0]


FORGERIES = {
    # The process's torch CPU stream (restored last, after the modules): an mt19937 state torch refuses.
    "torch-cpu-rng-bytes": lambda d: _fill_tensor(_rank_file(d), "per-rank state/rng/torch_cpu", 0xFF),
    # What the module's restore reads beside its tensors: its state_dict metadata.
    "module-metadata": lambda d: _edit_tree(_replicated_file(d), lambda tree: _put(
        _get(_get(_get(tree, "entries"), "model"), "state"), "metadata", "x")),
    # A NumPy Generator's bit-generator state of the wrong type.
    "numpy-generator-state": lambda d: _edit_tree(_rank_file(d), lambda tree: _put(
        _get(_get(_get(_get(tree, "entries"), "nrng"), "state"), "state"), "state", "notanint")),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_state_that_verifies_falls_back_to_the_older_step(tmp_path, forgery):
    root = str(tmp_path)
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, _state(0))
        mgr.save(2, _state(1))
    step2 = os.path.join(root, "step-000000002")
    FORGERIES[forgery](step2)
    _resign(step2)
    live = _state(5)
    with distckpt.CheckpointManager(root) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match="step 2"):
            progress = mgr.load_latest(live)
    assert progress is not None and progress.step == 1
    expected = _state(0)
    assert torch.equal(live["model"].weight, expected["model"].weight) and torch.equal(live["t"], expected["t"])
    assert live["nrng"].random() == expected["nrng"].random()


def test_an_optimizer_of_another_class_is_refused_and_nothing_changes(tmp_path):
    model = torch.nn.Linear(3, 3)
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    adamw.step()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"model": model, "opt": adamw})
    live_model = torch.nn.Linear(3, 3)
    sgd = torch.optim.SGD(live_model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in live_model.parameters()]
    groups = json.dumps(sgd.state_dict()["param_groups"])
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", distckpt.CheckpointFallbackWarning)
            with pytest.raises(distckpt.IncompatibleCheckpointError, match="SGD here but a AdamW"):
                mgr.load_latest({"model": live_model, "opt": sgd})
    assert all(torch.equal(a, b) for a, b in zip(before, live_model.parameters()))
    assert json.dumps(sgd.state_dict()["param_groups"]) == groups


@pytest.mark.parametrize("how", ["step-directory-copied", "replicated-file-of-another-step"])
def test_another_steps_files_under_this_steps_name_fall_back_and_verify_names_them(tmp_path, capsys, how):
    """A step directory copied under another step's name (nothing edited) loaded as that step
    with the first one's values; another step's replicated file sealed into a step (digests
    recomputed) too. Both verified 'ok'."""
    import shutil

    from distckpt.tools import cli
    root = str(tmp_path)
    with distckpt.CheckpointManager(root, keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    if how == "step-directory-copied":
        shutil.copytree(os.path.join(root, "step-000000001"), os.path.join(root, "step-000000005"))
        damaged, fallback, said = 5, 2, "its COMMITTED marker records step 1"
    else:
        step2 = os.path.join(root, "step-000000002")
        shutil.copy(_replicated_file(os.path.join(root, "step-000000001")), _replicated_file(step2))
        _resign(step2)
        damaged, fallback, said = 2, 1, "the file records step 1 epoch None, the manifest step 2"
    live = _state(9)
    with distckpt.CheckpointManager(root) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match=f"step {damaged}"):
            assert mgr.load_latest(live).step == fallback
    assert torch.equal(live["t"], _state(fallback)["t"])
    assert cli.main(["verify", root, "--step", str(damaged)]) == 1
    assert said in capsys.readouterr().out

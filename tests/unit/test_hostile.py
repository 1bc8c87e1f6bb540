"""Hostile or damaged files are refused before any tensor is built, in bounded time."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch

import distckpt
from distckpt.io import manifest as mf
from distckpt.io.safetensors_format import FORMAT_NAME, TREE_METADATA_KEY, safetensors_chunks
from distckpt.io.serialize import encode_tree, load_tree_file


def file_with(header: dict, data: bytes = b"", tree: object = None, reference: bool = True) -> bytes:
    """A tree file with `header`'s tensors; the tree references each of them unless told not to."""
    if tree is None:
        tree = {"d": [[name, {"T": name}] for name in header]} if reference else {"d": []}
    header = {"__metadata__": {"format": FORMAT_NAME, TREE_METADATA_KEY: json.dumps(tree)}, **header}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def refused(data: bytes, match: str) -> float:
    """The refusal's CPU seconds (this process's, so other work on a shared machine does not count:
    the bounds below catch work growing faster than the input, not a slow machine)."""
    start = time.process_time()
    with pytest.raises(distckpt.CorruptCheckpointError, match=match):
        load_tree_file(bytearray(data), "hostile")
    return time.process_time() - start


def test_a_huge_header_length_is_refused_before_parsing():
    assert refused(struct.pack("<Q", 2**62) + b"{}", "header length") < 1


def test_offsets_outside_the_file_are_refused():
    refused(file_with({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8), "claims bytes")
    refused(file_with({"t": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}), "claims bytes")
    refused(file_with({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "malformed entry")
    refused(file_with({"t": {"dtype": "X99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "malformed")


def test_overlapping_ranges_are_refused():
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    refused(file_with(header, b"\0" * 12), "overlaps")


def test_two_hundred_thousand_unreferenced_entries_are_refused_quickly():
    header = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    assert refused(file_with(header, reference=False), "not referenced by the tree") < 10


def test_more_tensors_than_the_limit_are_refused_on_load_and_at_save(monkeypatch):
    from distckpt.io import safetensors_format
    monkeypatch.setattr(safetensors_format, "MAX_TENSORS", 1000)
    header = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(1001)}
    assert refused(file_with(header), "more than any checkpoint holds") < 1
    with pytest.raises(distckpt.UnstorableValueError, match="at most 1,000"):
        encode_tree([torch.zeros(1) for _ in range(1001)])


def test_deeply_nested_trees_are_refused():
    raw = json.dumps({"__metadata__": {"format": FORMAT_NAME, TREE_METADATA_KEY: "[" * 100_000 + "]" * 100_000}}).encode()
    refused(struct.pack("<Q", len(raw)) + raw, "not valid")
    nested = '{"l": [' * 5_000 + "1" + "]}" * 5_000  # parses as JSON, deeper than decoding allows
    raw = json.dumps({"__metadata__": {"format": FORMAT_NAME, TREE_METADATA_KEY: nested}}).encode()
    raw += b" " * (-len(raw) % 8)
    refused(struct.pack("<Q", len(raw)) + raw, "not valid")
    assert load_tree_file(bytearray(file_with({})), "ok") == {}


@pytest.mark.parametrize("path", ["../outside", "/etc/passwd", "a/../../b", "s3://other/x", "x::s3://b/y",
                                  "nul\x00byte", "back\\slash"])
def test_manifest_paths_outside_the_step_are_refused(path):
    manifest = {"format": mf.FORMAT_VERSION, "step": 1, "files": {path: {"size": 1, "xxh3_64": "0"}}}
    raw = mf.manifest_bytes(manifest)
    marker = mf.Marker(1, mf.checksum_of(raw), "run")
    with pytest.raises(distckpt.CorruptCheckpointError, match="unsafe path"):
        mf.Manifest.parse(raw, marker, "hostile")


def test_a_pickle_in_place_of_a_payload_never_runs(ckpt_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    base = os.path.join(ckpt_dir, "step-000000001")
    payload = os.path.join(base, "replicated", "state.g000001.safetensors")
    torch.save({"w": Evil()}, payload)
    # forge the manifest and marker so the checksum matches: only the format can refuse it now
    manifest = json.load(open(os.path.join(base, "manifest.json")))
    data = open(payload, "rb").read()
    manifest["files"]["replicated/state.g000001.safetensors"] = {"size": len(data), "xxh3_64": mf.checksum_of(data)}
    raw = mf.manifest_bytes(manifest)
    open(os.path.join(base, "manifest.json"), "wb").write(raw)
    open(os.path.join(base, "COMMITTED"), "wb").write(mf.Marker(1, mf.checksum_of(raw), "forged").to_bytes())
    with distckpt.CheckpointManager(ckpt_dir) as mgr, pytest.warns(distckpt.CheckpointFallbackWarning):
        with pytest.raises(distckpt.CorruptCheckpointError):
            mgr.load_latest({"w": torch.zeros(2)})
    assert not canary.exists()


def test_a_valid_file_still_roundtrips_after_all_checks():
    value = {"a": torch.arange(10, dtype=torch.int16), "b": torch.tensor([True]), "c": torch.randn(3).double()}
    data = bytearray(b"".join(bytes(c) for c in safetensors_chunks(encode_tree(value))))
    back = load_tree_file(data, "ok")
    assert all(torch.equal(back[k], v) for k, v in value.items())


def test_a_symlink_planted_in_a_step_is_not_followed(ckpt_dir, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not yours")
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        mgr.save(2, {"w": torch.full((2,), 2.0)})
    target = os.path.join(ckpt_dir, "step-000000002", "ranks", "rank-00000.g000001.safetensors")
    os.remove(target)
    os.symlink(secret, target)
    state = {"w": torch.zeros(2)}
    with distckpt.CheckpointManager(ckpt_dir) as mgr, pytest.warns(distckpt.CheckpointFallbackWarning, match="symbolic link"):
        assert mgr.load_latest(state).step == 1
    assert torch.equal(state["w"], torch.ones(2))

"""Damage after commit, on local disk and S3: every kind of damage to every kind of file is
detected by checksum or structure, the loader falls back to the previous checkpoint with a
warning naming the file, and `distckpt verify` reports the same file with exit status 1."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import distckpt
from distckpt.io import manifest as mf
from distckpt.storage import open_storage
from distckpt.tools import cli

FILES = {"replicated": mf.replicated_file(1), "rank": mf.rank_file(0, 1), "manifest": mf.MANIFEST,
         "marker": mf.MARKER}


def flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0x01  # one flipped bit
    return bytes(out)


DAMAGE = {
    "flipped-bit": lambda s, p: s.write_file(p, [flip(s.read_bytes(p))]),
    "truncated": lambda s, p: s.write_file(p, [s.read_bytes(p)[: len(s.read_bytes(p)) // 2]]),
    "missing": lambda s, p: s.remove_file(p),
    "garbage": lambda s, p: s.write_file(p, [b"\x00garbage{" * 7]),
    # the digest changed and the marker rewritten as well-formed JSON (its own checksum now stale)
    "digest-bit": lambda s, p: s.write_file(p, [_flip_digest(s.read_bytes(p))]),
}


def _flip_digest(marker: bytes) -> bytes:
    import json

    d = json.loads(marker)
    digest = d["manifest_xxh3_64"]
    d["manifest_xxh3_64"] = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    return json.dumps(d).encode()
CASES = [(f, d) for f in ("replicated", "rank", "manifest") for d in DAMAGE if d != "digest-bit"] + [
    ("marker", "digest-bit"), ("marker", "garbage"), ("marker", "flipped-bit")]


S3_SAMPLE = {("replicated", "flipped-bit"), ("rank", "truncated"), ("manifest", "garbage"), ("marker", "digest-bit")}
PARAMS = [pytest.param(backend, which, how, id=f"{backend}-{which}-{how}",
                       marks=() if backend == "local" or (which, how) in S3_SAMPLE else pytest.mark.faults)
          for backend in ("local", "s3") for which, how in CASES]


@pytest.fixture
def url(backend, request, tmp_path, monkeypatch):
    """Every case on local disk; on S3 a sample by default, all of them with make test-faults."""
    if backend == "local":
        return str(tmp_path / "ckpt")
    server = request.getfixturevalue("s3_server")
    for k, v in server.env().items():  # the CLI and the manager read S3 settings from the environment
        monkeypatch.setenv(k, v)
    return request.getfixturevalue("s3_url")


def state_for(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": nn.Linear(32, 8), "gen": torch.Generator().manual_seed(step)}


@pytest.mark.parametrize("backend,which,how", PARAMS)
def test_damage_after_commit_falls_back_and_verify_names_the_file(backend, url, which, how, capsys):
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    storage = open_storage(url)
    DAMAGE[how](storage, f"{mf.step_dir(2)}/{FILES[which]}")
    name = FILES[which] if which != "marker" else "marker"

    state = state_for(0)
    with distckpt.CheckpointManager(url) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning) as warned:
            assert mgr.load_latest(state).step == 1
    message = str(warned[0].message)
    assert "step 2" in message and (name in message or (which == "manifest" and "manifest" in message)), message
    assert torch.equal(state["model"].weight, state_for(1)["model"].weight)  # the previous one, exactly

    capsys.readouterr()
    assert cli.main(["verify", url, "--step", "2"]) == 1
    out = capsys.readouterr().out
    assert name in out or (which == "manifest" and "manifest" in out), out
    assert cli.main(["verify", url, "--step", "1"]) == 0


def test_every_single_bit_flip_of_a_commit_marker_is_refused():
    """The marker's own fields (format, run_id, generation, nonce, step, digest) are covered by
    its checksum: before it, 484 of 1,376 single-bit flips (in run_id, nonce, format) still loaded."""
    marker = mf.Marker(7, "0123456789abcdef", "f" * 32, generation=3)
    data = marker.to_bytes()
    assert mf.Marker.parse(data, "m") == marker
    accepted = []
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            mf.Marker.parse(bytes(flipped), "m")
            accepted.append(bit)
        except distckpt.CorruptCheckpointError:
            pass
    assert accepted == [], f"{len(accepted)} of {len(data) * 8} flips accepted"


def test_a_marker_written_before_the_marker_checksum_still_loads():
    import json

    old = {"format": 1, "step": 7, "manifest_xxh3_64": "0123456789abcdef", "run_id": "r", "generation": 3, "nonce": "n"}
    assert mf.Marker.parse(json.dumps(old).encode(), "m") == mf.Marker(7, "0123456789abcdef", "r", 3, "n")
    with pytest.raises(distckpt.CorruptCheckpointError, match="fields we never write"):
        mf.Marker.parse(json.dumps({**old, "marker_xxh3_65": "00"}).encode(), "m")


MARKER_STAND_INS = {
    "symlink-loop": lambda path: os.symlink(path, path),
    "dangling-symlink": lambda path: os.symlink(path + ".gone", path),
    "symlink-to-an-older-marker": lambda path: os.symlink(path.replace(mf.step_dir(2), mf.step_dir(1)), path),
    "directory": lambda path: os.mkdir(path),
}


@pytest.mark.parametrize("stand_in", sorted(MARKER_STAND_INS))
def test_a_marker_that_is_no_file_is_damage_not_absence(tmp_path, stand_in, capsys):
    """A COMMITTED replaced by a link or a directory made its step look never committed: the
    damaged newest step was skipped with no warning, and `verify --all` left it out, exit 0."""
    url = str(tmp_path / "ckpt")
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    marker = os.path.join(url, mf.step_dir(2), mf.MARKER)
    os.remove(marker)
    MARKER_STAND_INS[stand_in](marker)
    state = state_for(0)
    with distckpt.CheckpointManager(url) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match=r"step 2 .*COMMITTED"):
            assert mgr.load_latest(state).step == 1
        assert torch.equal(state["model"].weight, state_for(1)["model"].weight)
        before = {k: v.clone() for k, v in state["model"].state_dict().items()}
        with pytest.raises(distckpt.CorruptCheckpointError, match="COMMITTED"):
            mgr.load(state, step=2)
        assert all(torch.equal(v, before[k]) for k, v in state["model"].state_dict().items())
    for args in (["--all"], ["--step", "2"]):  # a marker that is a directory too: it was "not committed"
        capsys.readouterr()
        assert cli.main(["verify", url, *args]) == 1, args
        assert "step 2: BAD" in capsys.readouterr().out

"""What a verified load checks each file against, on every path that reads one: the signed
BLAKE3 digest, in place of xxh3 (io/checksums.py verify_file). A file whose xxh3 matches but whose
BLAKE3 does not is refused: by a load, a cooperative load, load_weights and `distckpt verify`. A
file whose BLAKE3 matches is accepted at the file level whatever its record's xxh3 says, since
that record is vouched for by the same signature: an xxh3 edited in the manifest fails the
signature, so the step is refused before any file is read."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from forger import remake

import distckpt
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.protocol.cooperative import CooperativeRead
from distckpt.storage import open_storage
from distckpt.testing import run_world
from distckpt.tools import cli


@pytest.fixture(scope="module")
def keys():
    key = ed25519.Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return {"key": key, "priv": private, "pub": public}


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value), "step": int(value)}


def _save_two(root: str, keys: dict) -> None:
    with distckpt.CheckpointManager(root, signing_key=keys["priv"]) as mgr:
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))


def _load(root: str, keys: dict) -> tuple[distckpt.Progress | None, dict, list[str]]:
    state = _state(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(root, verify_key=keys["pub"]) as mgr:
            progress = mgr.load_latest(state)
    return progress, state, [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]


def _resign_with_another_digest(root: str, step: int, key: object) -> str:
    """Sign `step` again with the key itself, over a digest table (as `distckpt sign` writes one)
    that gives its replicated file another BLAKE3: the file's bytes and xxh3 still match the
    manifest, only the digest does not. Returns the file's name."""
    base = os.path.join(root, mf.step_dir(step))
    manifest = open(os.path.join(base, mf.MANIFEST), "rb").read()
    files = json.loads(manifest)["files"]
    table = {f"{mf.step_dir(step)}/{name}": record[signing.DIGEST] for name, record in files.items()}
    victim = next(name for name in files if name.startswith("replicated/"))
    table[f"{mf.step_dir(step)}/{victim}"] = signing.digest_of(b"other bytes")
    open(os.path.join(base, signing.SIGNATURE), "wb").write(signing.signature_bytes(key, manifest, table))
    return victim


def test_a_file_whose_xxh3_matches_but_whose_blake3_does_not_is_refused_by_every_reader(tmp_path, keys, capsys):
    root = str(tmp_path / "ckpt")
    _save_two(root, keys)
    _resign_with_another_digest(root, 2, keys["key"])
    progress, state, fallbacks = _load(root, keys)
    assert progress.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    assert len(fallbacks) == 1 and "step 2" in fallbacks[0] and "does not match the signed" in fallbacks[0], fallbacks
    with distckpt.CheckpointManager(root, verify_key=keys["pub"]) as mgr:
        with pytest.raises(distckpt.UntrustedCheckpointError, match="does not match the signed"):
            mgr.load(_state(0.0), 2)
    (tmp_path / "k.pub").write_bytes(keys["pub"])
    assert cli.main(["verify", root, "--key", str(tmp_path / "k.pub")]) == 1
    assert "does not match the signed" in capsys.readouterr().out
    with distckpt.CheckpointManager(root) as mgr:  # without a key: xxh3 alone, and it matches
        assert mgr.load_latest(_state(0.0)).step == 2


def test_load_weights_with_a_verify_key_refuses_a_file_whose_blake3_does_not_match(tmp_path, keys):
    root = str(tmp_path)
    model = torch.nn.Linear(3, 2)
    with distckpt.CheckpointManager(root, signing_key=keys["priv"]) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(step, {"model": model})
    _resign_with_another_digest(root, 2, keys["key"])
    target = torch.nn.Linear(3, 2)
    assert distckpt.load_weights(root, target, verify_key=keys["pub"]).step == 1
    assert torch.equal(target.weight, torch.full((2, 3), 1.0))
    assert distckpt.load_weights(root, target).step == 2  # without a key: xxh3 alone, and it matches


def test_an_xxh3_edited_in_the_signed_manifest_is_refused_though_the_blake3_matches(tmp_path, keys):
    root = str(tmp_path)
    _save_two(root, keys)
    raw = json.loads((tmp_path / mf.step_dir(2) / mf.MANIFEST).read_bytes())
    name = next(n for n in raw["files"] if n.startswith("replicated/"))
    raw["files"][name]["xxh3_64"] = "0" * 16
    remake(root, 2, raw)  # the marker re-made to match: only the signature can tell
    progress, state, fallbacks = _load(root, keys)
    assert progress.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    assert "signature is of another manifest" in fallbacks[0], fallbacks


def test_at_the_file_level_the_blake3_digest_decides_alone():
    """The decision behind one pass: with a verify key the xxh3 of the record is not read when
    the digest matches (the signature vouches for the record as a whole), and a file that fails
    the digest fails it whatever its xxh3 says."""
    data = os.urandom(3000)
    good = signing.digest_of(data)
    mf.verify_file(data, {"size": 3000, "xxh3_64": "0" * 16, signing.DIGEST: good}, "f", digest=True)
    with pytest.raises(distckpt.CorruptCheckpointError, match="checksum"):
        mf.verify_file(data, {"size": 3000, "xxh3_64": "0" * 16, signing.DIGEST: good}, "f")
    other = {"size": 3000, "xxh3_64": mf.checksum_of(data), signing.DIGEST: signing.digest_of(data[::-1])}
    with pytest.raises(distckpt.UntrustedCheckpointError, match="does not match the signed"):
        mf.verify_file(data, other, "f", digest=True)
    with pytest.raises(distckpt.CorruptCheckpointError, match="checksum"):  # damage is still named as damage
        mf.verify_file(data[:-1] + b"\x00", {**other, signing.DIGEST: good}, "f", digest=True)


class _OneRank:
    """A coordinator of a world of one, for CooperativeRead's phases."""

    rank, world_size = 0, 1

    def all_gather(self, value: object, label: str) -> list:
        return [value]

    def all_gather_into(self, outputs: list, tensor: torch.Tensor, label: str) -> None:
        outputs[0].copy_(tensor)


class _Ranged:
    """A local storage read in ranges, as an object store is by a cooperative load."""

    spill_dir = None

    def __init__(self, inner: object) -> None:
        self.inner, self.url = inner, inner.url  # type: ignore[attr-defined]

    def size(self, path: str) -> int | None:
        return self.inner.size(path)  # type: ignore[attr-defined]

    def read_range(self, path: str, start: int, end: int, put: object) -> None:
        put(start, bytes(self.inner.read_buffer(path)[start:end]))  # type: ignore[attr-defined,operator]


def test_a_cooperative_read_checks_the_signed_digest_with_a_verify_key(tmp_path, keys):
    data = os.urandom(3 << 20)  # above cooperative.MIN_BYTES: read in ranges, not whole
    (tmp_path / "f").write_bytes(data)
    storage = _Ranged(open_storage(str(tmp_path)))
    record = {"size": len(data), "xxh3_64": mf.checksum_of(data), signing.DIGEST: signing.digest_of(b"other")}
    assert bytes(CooperativeRead(_OneRank(), storage, 1).read("f", record, "f")) == data  # no key: xxh3
    signing.attach(storage, signing.Trust(verifier=keys["key"].public_key()))
    with pytest.raises(distckpt.UntrustedCheckpointError, match="does not match the signed"):
        CooperativeRead(_OneRank(), storage, 1).read("f", record, "f")
    record[signing.DIGEST] = signing.digest_of(data)
    assert bytes(CooperativeRead(_OneRank(), storage, 1).read("f", record, "f")) == data


def test_a_two_rank_cooperative_load_from_s3_refuses_a_file_whose_blake3_does_not_match(s3_server, s3_url, keys):
    from test_s3 import fast_options

    results = run_world("sign_workers:cooperative_load_past_a_wrong_digest", 2, timeout=180, url=s3_url,
                        options=fast_options(s3_server.storage_options()), key=keys["priv"], pub=keys["pub"])
    assert all(r.error is None for r in results), [r.error for r in results]
    for r in results:
        assert r.value["exchanges"] >= 1, "the replicated file was not read cooperatively"
        assert r.value["step"] == 1 and r.value["same"], r.value
        assert "does not match the signed" in r.value["warned"][0], r.value["warned"]

"""Signed checkpoints (io/signing.py): a verify key loads only what its signing key signed, and
falls back past a forged, unsigned or foreign step to the previous one that verifies."""

from __future__ import annotations

import base64
import glob
import json
import logging
import os
import warnings

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from forger import forge_step, payload_start
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.testing import run_world

EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40"))


def _pem(key: object) -> tuple[bytes, bytes]:
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,  # type: ignore[attr-defined]
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,  # type: ignore[attr-defined]
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


@pytest.fixture(scope="module")
def keys():
    a, b = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    (a_priv, a_pub), (b_priv, b_pub) = _pem(a), _pem(b)
    return {"a": a, "b": b, "a_priv": a_priv, "a_pub": a_pub, "b_priv": b_priv, "b_pub": b_pub}


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value), "step": int(value)}


def _save_two(root: str, keys: dict, **options) -> None:
    with distckpt.CheckpointManager(root, signing_key=keys["a_priv"], **options) as mgr:
        mgr.load_latest(_state(0.0))
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))


def _load(root: str, key: bytes | None, **options) -> tuple[distckpt.Progress | None, dict, list[str]]:
    state = _state(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(root, verify_key=key, **options) as mgr:
            progress = mgr.load_latest(state)
    return progress, state, [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]


def test_a_signed_round_trip_writes_digests_and_a_signature_before_the_marker(tmp_path, keys):
    root = str(tmp_path)
    _save_two(root, keys)
    for step in (1, 2):
        base = tmp_path / mf.step_dir(step)
        raw = json.loads((base / mf.MANIFEST).read_bytes())
        assert all(len(r[signing.DIGEST]) == 64 for r in raw["files"].values())
        body = json.loads((base / signing.SIGNATURE).read_bytes())
        assert body["key"] == signing.fingerprint(keys["a"].public_key()) and body["algorithm"] == "ed25519"
    progress, state, fallbacks = _load(root, keys["a_pub"])
    assert progress.step == 2 and torch.equal(state["w"], torch.full((64,), 2.0)) and fallbacks == []


def test_the_signature_is_written_before_the_marker(tmp_path, keys, monkeypatch):
    """A save killed between the two leaves an uncommitted step, never a committed unsigned one."""
    from distckpt.protocol import commit, saving
    order = []
    real_sign, real_marker = signing.sign_step, commit.create_marker
    monkeypatch.setattr(saving.signing, "sign_step", lambda *a: (order.append("signature"), real_sign(*a)))
    monkeypatch.setattr(saving, "create_marker", lambda *a: (order.append("marker"), real_marker(*a)))
    with distckpt.CheckpointManager(str(tmp_path), signing_key=keys["a_priv"]) as mgr:
        mgr.save(1, _state(1.0))
    assert order == ["signature", "marker"]


def test_keys_from_the_environment_and_paths(tmp_path, keys, monkeypatch):
    (tmp_path / "k.pem").write_bytes(keys["a_priv"])
    monkeypatch.setenv(signing.SIGNING_ENV, str(tmp_path / "k.pem"))
    root = str(tmp_path / "root")
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1.0))
    monkeypatch.delenv(signing.SIGNING_ENV)
    monkeypatch.setenv(signing.VERIFY_ENV, keys["b_pub"].decode())  # PEM text
    with pytest.raises(distckpt.CorruptCheckpointError, match="verifies"):
        _load(root, None)
    monkeypatch.setenv(signing.VERIFY_ENV, keys["a_pub"].decode())
    assert _load(root, None)[0].step == 1


def test_a_forged_step_is_refused_and_the_previous_signed_step_loads(tmp_path, keys):
    root = str(tmp_path)
    _save_two(root, keys)
    forge_step(root, 2)  # tensor bytes, xxh3 and BLAKE3, manifest and marker, all consistent
    progress, state, _ = _load(root, None)
    assert progress.step == 2 and torch.isinf(state["w"][0])  # without a key the forgery loads: xxh3 is no defence
    progress, state, fallbacks = _load(root, keys["a_pub"])
    assert progress.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    assert len(fallbacks) == 1 and "step 2" in fallbacks[0] and "signature is of another manifest" in fallbacks[0]


@pytest.mark.parametrize("signature, said", [("remove", "not signed"), ("resign", "not by the verify key")])
def test_a_forged_step_without_a_valid_signature_falls_back(tmp_path, keys, signature, said):
    root = str(tmp_path)
    _save_two(root, keys)
    forge_step(root, 2, signature=signature, other_key=keys["b"])
    progress, state, fallbacks = _load(root, keys["a_pub"])
    assert progress.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    assert said in fallbacks[0]


def test_a_signature_by_the_key_over_a_manifest_without_digests_is_refused(tmp_path, keys):
    """Even the key holder's signature vouches for nothing a forger could recompute (xxh3 alone)."""
    root = str(tmp_path)
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1.0))
    base = tmp_path / mf.step_dir(1)
    (base / signing.SIGNATURE).write_bytes(signing.signature_bytes(keys["a"], (base / mf.MANIFEST).read_bytes()))
    with pytest.raises(distckpt.CorruptCheckpointError, match="verifies"):
        _load(root, keys["a_pub"])


def test_a_digest_mismatch_is_refused_even_where_xxh3_matches():
    data = b"x" * 1000
    record = {"size": 1000, "xxh3_64": mf.checksum_of(data), signing.DIGEST: signing.digest_of(b"y" * 1000)}
    mf.verify_file(data, record, "f")  # without a verify key: xxh3 alone
    with pytest.raises(distckpt.UntrustedCheckpointError, match="does not match the signed"):
        mf.verify_file(data, record, "f", digest=True)
    with pytest.raises(distckpt.UntrustedCheckpointError, match="no blake3"):
        mf.verify_file(data, {"size": 1000, "xxh3_64": mf.checksum_of(data)}, "f", digest=True)


def test_an_unsigned_checkpoint_with_a_verify_key_is_refused_fail_closed(tmp_path, keys):
    root = str(tmp_path)
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1.0))
    state = _state(0.0)
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="not signed"):
        with pytest.raises(distckpt.CorruptCheckpointError, match="no committed checkpoint .* verifies"):
            with distckpt.CheckpointManager(root, verify_key=keys["a_pub"]) as mgr:
                mgr.load_latest(state)
    assert torch.equal(state["w"], torch.zeros(64))  # nothing changed
    with distckpt.CheckpointManager(root, verify_key=keys["a_pub"]) as mgr:
        with pytest.raises(distckpt.UntrustedCheckpointError, match="not signed"):
            mgr.load(state, 1)


_FILES = ["replicated", "rank", "manifest", "marker", "signature"]


@settings(max_examples=min(EXAMPLES, 25), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(_FILES), where=st.floats(0, 0.999), forged=st.booleans(), byte=st.integers(1, 255))
def test_any_tampered_byte_of_any_file_never_loads(tmp_path_factory, keys, which, where, forged, byte):
    """A byte xor-ed anywhere in any file of the newest step, with (forged) or without the
    checksums re-made: the load falls back to step 1, whole, every time."""
    root = str(tmp_path_factory.mktemp("t"))
    _save_two(root, keys)
    base = os.path.join(root, mf.step_dir(2))
    raw = json.loads(open(os.path.join(base, mf.MANIFEST), "rb").read())
    names = {"replicated": next(n for n in raw["files"] if n.startswith("replicated/")),
             "rank": next(n for n in raw["files"] if n.startswith("ranks/")),
             "manifest": mf.MANIFEST, "marker": mf.MARKER, "signature": signing.SIGNATURE}
    name = names[which]
    path = os.path.join(base, name)
    data = open(path, "rb").read()
    if forged and which in ("replicated", "rank"):
        start = payload_start(data)
        offset = int(where * (len(data) - start))
        forge_step(root, 2, name, offset, bytes([data[start + offset] ^ byte]))
    else:
        at = int(where * len(data))
        open(path, "wb").write(data[:at] + bytes([data[at] ^ byte]) + data[at + 1:])
    progress, state, fallbacks = _load(root, keys["a_pub"])
    assert progress.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0)) and fallbacks


def test_no_key_material_in_any_file_log_repr_or_error(tmp_path, keys, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    raw = keys["a"].private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                  serialization.NoEncryption())
    body = b"".join(keys["a_priv"].splitlines()[1:-1])  # the PEM's base64 text
    root = str(tmp_path / "root")
    with distckpt.CheckpointManager(root, signing_key=keys["a_priv"], verify_key=keys["a_pub"],
                                    incremental=True) as mgr:
        mgr.load_latest(_state(0.0))
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))
        shown = repr(mgr) + repr(mgr.config) + repr(mgr._session) + str(vars(mgr.config))
    errors = []
    for bad in (keys["a_priv"][:-30], keys["a_priv"].replace(b"PRIVATE KEY", b"PUBLIC KEY"), keys["a_pub"] + b"x"):
        try:
            distckpt.CheckpointManager(str(tmp_path / "r2"), signing_key=bad)
        except distckpt.ConfigError as e:
            errors.append(str(e))
    try:
        distckpt.CheckpointManager(str(tmp_path / "r3"), verify_key=keys["a_priv"])
    except distckpt.ConfigError as e:
        errors.append(str(e))
    out, err = capfd.readouterr()
    texts = [shown.encode(), caplog.text.encode(), out.encode(), err.encode(), "".join(errors).encode()]
    texts += [open(f, "rb").read() for f in glob.glob(os.path.join(root, "**"), recursive=True) if os.path.isfile(f)]
    for secret in (raw, body, base64.b64encode(raw), raw.hex().encode()):
        assert not any(secret in text for text in texts)
    assert len(errors) == 4


def _rsa_pem() -> tuple[bytes, bytes]:
    return _pem(rsa.generate_private_key(public_exponent=65537, key_size=1024))


@pytest.mark.parametrize("arg, value, said", [
    ("signing_key", b"not a key", "not PEM"),
    ("signing_key", "rsa_priv", "Ed25519 private key; it holds a RSA"),
    ("signing_key", "a_pub", "a public key was given"),
    ("signing_key", "/no/such/file.pem", "cannot be read"),
    ("signing_key", 3.5, "must be PEM bytes"),
    ("verify_key", "a_priv", "a private key was given"),
    ("verify_key", "rsa_pub", "Ed25519 public key; it holds a RSA"),
    ("verify_key", b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "does not parse"),
])
def test_a_wrong_format_key_is_a_config_error_naming_the_argument(tmp_path, keys, arg, value, said):
    rsa_priv, rsa_pub = _rsa_pem()
    value = {"rsa_priv": rsa_priv, "rsa_pub": rsa_pub, "a_pub": keys["a_pub"], "a_priv": keys["a_priv"]}.get(value, value) \
        if isinstance(value, str) else value
    with pytest.raises(distckpt.ConfigError, match=arg) as caught:
        distckpt.CheckpointManager(str(tmp_path), **{arg: value})
    assert said in str(caught.value)


def test_async_saves_and_two_tiers_sign_both_tiers_and_uploads_carry_the_signature(tmp_path, keys):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with distckpt.CheckpointManager(durable, local_dir=local, durable_every=2, async_save=True,
                                    signing_key=keys["a_priv"], verify_key=keys["a_pub"]) as mgr:
        mgr.load_latest(_state(0.0))
        for step in (1, 2, 3):
            mgr.save(step, _state(float(step)))
    for root, steps in ((durable, (2, 3)), (local, (2, 3))):
        for step in steps:
            assert os.path.exists(os.path.join(root, mf.step_dir(step), signing.SIGNATURE)), (root, step)
    progress, state, _ = _load(durable, keys["a_pub"])
    assert progress.step == 3 and state["step"] == 3
    forge_step(local, 3)  # the local tier forged: the durable copy of step 3 loads instead
    progress, state, fallbacks = _load(durable, keys["a_pub"], local_dir=local)
    assert (progress.step, progress.tier) == (3, "durable") and state["step"] == 3 and fallbacks


def test_incremental_references_are_covered_by_the_referencing_steps_signature(tmp_path, keys):
    root = str(tmp_path)
    frozen = torch.arange(256.0)
    with distckpt.CheckpointManager(root, incremental=True, signing_key=keys["a_priv"]) as mgr:
        mgr.load_latest({"frozen": frozen, "w": torch.zeros(4)})
        mgr.save(1, {"frozen": frozen, "w": torch.zeros(4)})
        mgr.save(2, {"frozen": frozen, "w": torch.ones(4)})
    raw = json.loads((tmp_path / mf.step_dir(2) / mf.MANIFEST).read_bytes())
    assert raw["shared_files"] and all(len(r[signing.DIGEST]) == 64 for r in raw["shared_files"].values())
    state = {"frozen": torch.zeros(256), "w": torch.zeros(4)}
    with distckpt.CheckpointManager(root, verify_key=keys["a_pub"]) as mgr:
        assert mgr.load_latest(state).step == 2 and torch.equal(state["frozen"], frozen)
    forge_step(root, 1, signature="keep")  # the shared file rewritten, step 1's checksums re-made
    with pytest.raises(distckpt.CorruptCheckpointError, match="verifies"):
        with distckpt.CheckpointManager(root, verify_key=keys["a_pub"]) as mgr:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mgr.load_latest(state)
    assert torch.equal(state["frozen"], frozen)


def test_a_signed_round_trip_on_s3(s3_server, s3_url, keys):
    from test_s3 import fast_options

    options = fast_options(s3_server.storage_options())
    with distckpt.CheckpointManager(s3_url, signing_key=keys["a_priv"], storage_options=options) as mgr:
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))
    progress, state, _ = _load(s3_url, keys["a_pub"], storage_options=options)
    assert progress.step == 2 and state["step"] == 2
    with pytest.raises(distckpt.CorruptCheckpointError, match="verifies"):
        _load(s3_url, keys["b_pub"], storage_options=options)


def test_a_signing_key_on_some_ranks_only_is_refused_on_every_rank(tmp_path, keys):
    results = run_world("sign_workers:signing_on_rank_zero_only", 2, timeout=90, url=str(tmp_path),
                        key=keys["a_priv"])
    assert all(r.error_type == "ConfigError" and "signing_key" in r.error for r in results), results
    assert all(keys["a_priv"].decode() not in r.error for r in results)


def test_two_ranks_sign_their_own_files_and_both_fall_back_past_a_forged_step(tmp_path, keys):
    results = run_world("sign_workers:save_signed_forge_and_resume", 2, timeout=120, url=str(tmp_path),
                        key=keys["a_priv"], pub=keys["a_pub"])
    assert all(r.error is None for r in results), [r.error for r in results]
    for rank, r in enumerate(results):
        assert r.value["step"] == 1 and r.value["w"] == [1.0] * 8 and r.value["mine"] == [float(rank)] * 4
        assert r.value["warned"] and "signature is of another manifest" in r.value["warned"][0]
    raw = json.loads((tmp_path / mf.step_dir(1) / mf.MANIFEST).read_bytes())
    assert sum(1 for n in raw["files"] if n.startswith("ranks/")) == 2
    assert all(signing.DIGEST in r for r in raw["files"].values())


def test_the_error_when_no_step_verifies_names_the_verify_key(tmp_path, keys):
    root = str(tmp_path)
    _save_two(root, keys)
    with pytest.raises(distckpt.CorruptCheckpointError) as caught:
        _load(root, keys["b_pub"])
    assert signing.fingerprint(keys["b"].public_key()) in str(caught.value)
    assert "distckpt verify URL --key" in str(caught.value)


def test_the_memory_tier_carries_the_signature_and_a_forged_memory_copy_falls_back(tmp_path, keys, monkeypatch):
    """A signed step's memory copy holds its SIGNATURE and resumes verified from memory; a memory copy
    forged by whoever can write the node's shared memory (bytes, xxh3, BLAKE3, manifest, marker) is
    refused by the verify key and the disk tier's step loads instead."""
    shm = tmp_path / "shm"
    monkeypatch.setenv("DISTCKPT_MEMORY_DIR", str(shm))
    root = str(tmp_path / "ckpt")
    _save_two(root, keys, memory_tier=True)
    own = str(shm / "own")
    assert (shm / "own" / mf.step_dir(2) / signing.SIGNATURE).read_bytes() == \
        (tmp_path / "ckpt" / mf.step_dir(2) / signing.SIGNATURE).read_bytes()
    state = _state(0.0)
    with distckpt.CheckpointManager(root, verify_key=keys["a_pub"], memory_tier=True) as mgr:
        progress = mgr.load_latest(state)
    assert (progress.step, progress.tier) == (2, "memory") and torch.equal(state["w"], torch.full((64,), 2.0))
    forge_step(own, 2)
    progress, state, fallbacks = _load(root, keys["a_pub"], memory_tier=True)
    assert progress.step == 2 and progress.tier != "memory" and torch.equal(state["w"], torch.full((64,), 2.0))
    assert fallbacks, "the forged memory copy was passed over without a word"


@pytest.mark.parametrize("options", [{"async_save": True, "writer": "process"},
                                     {"async_save": True, "staging_bytes": 100},
                                     {"async_save": True, "writer": "process", "staging_bytes": 100}],
                         ids=["writer-process", "bounded-staging", "both"])
def test_payload_files_written_by_the_writer_process_or_under_a_bound_carry_their_digests(tmp_path, keys, options):
    """Every payload file's record holds its digest whoever writes it (the writer thread, the
    writer process, a bounded staging pool), so a signed step verifies."""
    root = str(tmp_path)
    _save_two(root, keys, **options)
    for step in (1, 2):
        raw = json.loads((tmp_path / mf.step_dir(step) / mf.MANIFEST).read_bytes())
        assert all(len(r.get(signing.DIGEST, "")) == 64 for r in raw["files"].values()), raw["files"]
    progress, state, fallbacks = _load(root, keys["a_pub"])
    assert progress.step == 2 and torch.equal(state["w"], torch.full((64,), 2.0)) and fallbacks == []

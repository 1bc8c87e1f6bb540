"""`distckpt export --sign` / `export_weights(sign_key=)`: a signature in the OpenSSF model-signing
format (io/model_signature.py), checked with model-signing's own verifier, its API and its
command line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import model_signing
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from torch import nn

import distckpt
from distckpt.errors import ConfigError
from distckpt.tools import cli

CURVES = {"p256": ec.SECP256R1(), "p384": ec.SECP384R1(), "p521": ec.SECP521R1()}


def _pem(key, encryption=None) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             encryption or serialization.NoEncryption())


def _public_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """A private and public PEM file per accepted curve, and keys model-signing refuses."""
    folder = tmp_path_factory.mktemp("keys")
    out = {}
    for name, curve in CURVES.items():
        key = ec.generate_private_key(curve)
        (folder / f"{name}.pem").write_bytes(_pem(key))
        (folder / f"{name}.pub").write_bytes(_public_pem(key))
        out[name], out[f"{name}_pub"] = str(folder / f"{name}.pem"), str(folder / f"{name}.pub")
    # an SEC1 key, as `openssl ecparam -genkey` writes it ("BEGIN EC PRIVATE KEY")
    sec1 = ec.generate_private_key(ec.SECP256R1())
    (folder / "sec1.pem").write_bytes(sec1.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.TraditionalOpenSSL,
                                                         serialization.NoEncryption()))
    (folder / "sec1.pub").write_bytes(_public_pem(sec1))
    out["sec1"], out["sec1_pub"] = str(folder / "sec1.pem"), str(folder / "sec1.pub")
    refused = {
        "ed25519": _pem(ed25519.Ed25519PrivateKey.generate()),
        "rsa": _pem(rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        "secp256k1": _pem(ec.generate_private_key(ec.SECP256K1())),
        "public": _public_pem(ec.generate_private_key(ec.SECP256R1())),
        "encrypted": _pem(ec.generate_private_key(ec.SECP256R1()),
                          serialization.BestAvailableEncryption(b"secret")),
        "not-pem": b"not a key at all\n",
    }
    for name, data in refused.items():
        (folder / f"{name}.pem").write_bytes(data)
        out[name] = str(folder / f"{name}.pem")
    out["missing"] = str(folder / "no-such-key.pem")
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A committed checkpoint whose model is a few tensors (about 20 KB)."""
    url = str(tmp_path_factory.mktemp("ckpt") / "run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(5, {"model": model})
    return url


def verify(model_dir, signature, public_key) -> None:
    """model-signing's own verifier (its API): ValueError when the directory does not match."""
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(model_dir, signature)


def files_under(folder) -> dict[str, bytes]:
    found = {}
    for here, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(here, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


@pytest.mark.parametrize("curve", ["p256", "p384", "p521", "sec1"])
@pytest.mark.parametrize("shards", ["single", "sharded"])
def test_an_export_signed_with_each_accepted_key_verifies_with_model_signing(root, tmp_path, keys, curve, shards):
    out = tmp_path / "hf"
    size = "5GB" if shards == "single" else "8KB"
    summary = distckpt.export_weights(root, str(out), sign_key=keys[curve], max_shard_size=size)
    assert summary.signature == str(tmp_path / "hf.sig")  # beside the directory, not in it
    assert (len(summary.files) > 2) == (shards == "sharded"), summary.files
    assert not any(name.endswith(".sig") for name in os.listdir(out))
    verify(out, summary.signature, keys[f"{curve}_pub"])
    with pytest.raises(ValueError, match="Key mismatch"):  # another key's public half does not verify it
        verify(out, summary.signature, keys["p256_pub" if curve != "p256" else "p384_pub"])


def test_the_statement_names_every_exported_file_with_its_sha256(root, tmp_path, keys):
    import base64
    import hashlib

    out = tmp_path / "hf"
    summary = distckpt.export_weights(root, str(out), sign_key=keys["p256"], max_shard_size="8KB")
    bundle = json.loads(open(summary.signature).read())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    resources = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    on_disk = {name: hashlib.sha256(data).hexdigest() for name, data in files_under(out).items()}
    assert resources == on_disk and set(summary.files) == set(on_disk)
    assert statement["subject"][0]["name"] == "hf"


@pytest.mark.parametrize("damage", ["flipped byte", "added file", "removed shard", "index edited"])
def test_a_changed_export_fails_model_signing_verification(root, tmp_path, keys, damage):
    out = tmp_path / "hf"
    summary = distckpt.export_weights(root, str(out), sign_key=keys["p256"], max_shard_size="8KB")
    verify(out, summary.signature, keys["p256_pub"])
    shard = out / summary.files[0]
    if damage == "flipped byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "added file":
        (out / "extra.bin").write_bytes(b"\0")
    elif damage == "removed shard":
        shard.unlink()
    else:
        index = out / "model.safetensors.index.json"
        index.write_text(index.read_text().replace('"total_size"', '"total_size" '))
    with pytest.raises(ValueError, match="Signature mismatch"):
        verify(out, summary.signature, keys["p256_pub"])


@pytest.mark.parametrize("kind,said", [("ed25519", "Ed25519 key"), ("rsa", "RSA key"), ("secp256k1", "secp256k1"),
                                       ("public", "a public key was given"), ("encrypted", "encrypted"),
                                       ("not-pem", "not PEM"), ("missing", "cannot be read")])
@pytest.mark.parametrize("earlier", [False, True])
def test_a_key_model_signing_refuses_is_a_config_error_before_anything_is_written(root, tmp_path, keys, kind, said,
                                                                                  earlier):
    out = tmp_path / "hf"
    if earlier:
        distckpt.export_weights(root, str(out), max_shard_size="8KB")
    before = files_under(tmp_path)
    with pytest.raises(ConfigError) as caught:
        distckpt.export_weights(root, str(out), sign_key=keys[kind])
    text = str(caught.value)
    assert said in text and "sign_key" in text, text
    if kind not in ("encrypted", "public", "missing"):
        assert "P-256" in text and "openssl ecparam -name prime256v1 -genkey" in text, text
    assert files_under(tmp_path) == before  # no export, no signature, the earlier export untouched
    body = open(keys[kind], "rb").read().splitlines()[1:2] if os.path.exists(keys[kind]) else []
    assert not body or body[0].decode(errors="replace") not in text  # never a line of the key


def test_the_key_never_reaches_the_log(root, tmp_path, keys, caplog):
    with caplog.at_level(logging.DEBUG, logger="distckpt"):
        summary = distckpt.export_weights(root, str(tmp_path / "hf"), sign_key=keys["p256"])
    key_lines = [line for line in open(keys["p256"]).read().splitlines() if not line.startswith("-----")]
    assert "signed for OpenSSF model-signing" in caplog.text
    assert not any(line in caplog.text for line in key_lines)
    verify(tmp_path / "hf", summary.signature, keys["p256_pub"])


def test_a_signature_inside_the_directory_is_recorded_as_ignored(root, tmp_path, keys):
    out = tmp_path / "hf"
    summary = distckpt.export_weights(root, str(out), sign_key=keys["p256"], signature=str(out / "model.sig"))
    assert summary.signature == str(out / "model.sig") and (out / "model.sig").is_file()
    verify(out, out / "model.sig", keys["p256_pub"])
    # signed again in place: the old signature is not hashed into the new one
    summary = distckpt.export_weights(root, str(out), sign_key=keys["p384"], signature=str(out / "model.sig"))
    verify(out, out / "model.sig", keys["p384_pub"])


@pytest.mark.parametrize("where,said", [("model.safetensors", "one the export writes"),
                                        ("model.safetensors.index.json", "one the export writes"),
                                        ("hf", "export directory itself"), ("nowhere/x.sig", "does not exist"),
                                        (".", "is a directory")])
def test_a_signature_path_that_cannot_be_used_is_refused_before_anything_is_written(root, tmp_path, keys, where, said):
    out = tmp_path / "hf"
    path = str(out / where) if where.startswith("model") else str(tmp_path / where)
    with pytest.raises(ConfigError, match=said):
        distckpt.export_weights(root, str(out), sign_key=keys["p256"], signature=path)
    assert not out.exists()


def test_a_signature_without_a_key_and_a_link_in_the_directory_are_refused(root, tmp_path, keys):
    out = tmp_path / "hf"
    with pytest.raises(ConfigError, match="give sign_key too"):
        distckpt.export_weights(root, str(out), signature=str(tmp_path / "x.sig"))
    assert not out.exists()
    distckpt.export_weights(root, str(out))
    os.symlink(str(tmp_path), str(out / "link"))
    before = files_under(out)
    with pytest.raises(ConfigError, match="symbolic link"):
        distckpt.export_weights(root, str(out), sign_key=keys["p256"])
    assert files_under(out) == before and not (tmp_path / "hf.sig").exists()


def test_a_re_export_with_fewer_shards_is_signed_without_the_stale_ones(root, tmp_path, keys):
    out = tmp_path / "hf"
    distckpt.export_weights(root, str(out), sign_key=keys["p256"], max_shard_size="8KB")
    summary = distckpt.export_weights(root, str(out), sign_key=keys["p256"])
    assert summary.files == ["model.safetensors"] and sorted(os.listdir(out)) == ["model.safetensors"]
    verify(out, summary.signature, keys["p256_pub"])


def _model_signing_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_signing", *args], capture_output=True, text=True, timeout=120)


def test_the_cli_signs_and_model_signing_s_cli_verifies(root, tmp_path, keys, capsys):
    out = tmp_path / "hf"
    code = cli.main(["export", root, str(out), "--sign", keys["p256"], "--max-shard-size", "8KB", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["signature"] == str(tmp_path / "hf.sig"), summary
    done = _model_signing_cli("verify", "key", str(out), "--signature", summary["signature"],
                              "--public_key", keys["p256_pub"])
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done.stdout + done.stderr
    (out / "README.md").write_text("added after signing\n")
    done = _model_signing_cli("verify", "key", str(out), "--signature", summary["signature"],
                              "--public_key", keys["p256_pub"])
    assert done.returncode == 1 and "Extra files" in done.stderr, done.stdout + done.stderr


def test_the_cli_writes_a_signature_inside_the_directory_that_model_signing_s_cli_verifies(root, tmp_path, keys, capsys):
    out = tmp_path / "hf"
    code = cli.main(["export", root, str(out), "--sign", keys["p384"], "--signature", str(out / "model.sig")])
    text = capsys.readouterr().out
    assert code == 0 and "signed for OpenSSF model-signing" in text and "model_signing verify key" in text, text
    done = _model_signing_cli("verify", "key", str(out), "--signature", str(out / "model.sig"),
                              "--public_key", keys["p384_pub"])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("argv,said", [(["--sign", "ed25519"], "--sign: expected an elliptic-curve private key"),
                                       (["--signature", "x.sig"], "--signature: names where"),
                                       (["--sign", "p256", "--signature", "hf/model.safetensors"],
                                        "one the export writes")])
def test_the_cli_refuses_a_wrong_key_or_signature_path_with_exit_2_and_writes_nothing(root, tmp_path, keys, capsys,
                                                                                      argv, said):
    argv = [keys.get(a, str(tmp_path / a) if a.endswith(("sig", "safetensors")) else a) for a in argv]
    code = cli.main(["export", root, str(tmp_path / "hf"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and said in err, err
    assert os.listdir(tmp_path) == []

"""`distckpt sign`, `verify --key`, `ls --verify --key` and `export --key` (io/signing.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from forger import forge_step
from torch import nn

import distckpt
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.tools import cli


@pytest.fixture(scope="module")
def key_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("a", "b"):
        key = ed25519.Ed25519PrivateKey.generate()
        (folder / f"{name}.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (folder / f"{name}.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        out[name], out[f"{name}_pub"] = str(folder / f"{name}.pem"), str(folder / f"{name}.pub")
    return out


def make_run(url: str, signing_key: str | None = None, steps=(1, 2, 3)) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with distckpt.CheckpointManager(url, signing_key=signing_key) as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(step)
            mgr.save(step, {"model": model})


def run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_verify_with_a_key_checks_every_step_and_names_the_first_bad_one(url, capsys, key_files):
    make_run(url, key_files["a"])
    code, out = run(capsys, "verify", url, "--key", key_files["a_pub"])
    assert code == 0 and out.count(": ok") == 3, out
    code, out = run(capsys, "verify", url, "--key", key_files["b_pub"])
    assert code == 1 and "first bad step: step 1" in out and "not by the verify key" in out, out
    code, out = run(capsys, "verify", url, "--key", key_files["a_pub"], "--json")
    assert code == 0 and all(r["ok"] for r in json.loads(out))


def test_sign_makes_an_unsigned_committed_step_verify(url, capsys, key_files):
    make_run(url)
    code, out = run(capsys, "verify", url, "--key", key_files["a_pub"])
    assert code == 1 and "not signed" in out
    for step in (1, 2, 3):
        code, out = run(capsys, "sign", url, "--key", key_files["a"], "--step", str(step))
        assert code == 0 and f"signed step {step}" in out, out
    code, out = run(capsys, "verify", url, "--key", key_files["a_pub"])
    assert code == 0, out
    state = {"model": nn.Linear(3, 2)}
    with distckpt.CheckpointManager(url, verify_key=key_files["a_pub"]) as mgr:
        assert mgr.load_latest(state).step == 3


def test_sign_refuses_a_damaged_or_uncommitted_step_and_writes_nothing(tmp_path, capsys, key_files):
    url = str(tmp_path / "ckpt")
    make_run(url)
    replicated = next(n for n in os.listdir(tmp_path / "ckpt" / mf.step_dir(2) / "replicated"))
    path = tmp_path / "ckpt" / mf.step_dir(2) / "replicated" / replicated
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    code, out = run(capsys, "sign", url, "--key", key_files["a"], "--step", "2")
    assert code == 2 and "damaged" in out and "nothing signed" in out, out
    assert not (tmp_path / "ckpt" / mf.step_dir(2) / signing.SIGNATURE).exists()
    code, out = run(capsys, "sign", url, "--key", key_files["a"], "--step", "7")
    assert code == 2 and "not committed" in out, out
    code, out = run(capsys, "sign", url, "--key", key_files["a_pub"], "--step", "1")
    assert code == 2 and "a public key was given" in out, out


def test_ls_verify_with_a_key_marks_a_forged_step(tmp_path, capsys, key_files):
    url = str(tmp_path / "ckpt")
    make_run(url, key_files["a"])
    forge_step(url, 3)
    code, out = run(capsys, "ls", url, "--verify")
    assert code == 0, out  # without the key the forgery passes every checksum
    code, out = run(capsys, "ls", url, "--verify", "--key", key_files["a_pub"])
    assert code == 1 and "signature is of another manifest" in out, out


def test_export_and_load_weights_with_a_verify_key_skip_a_forged_step(tmp_path, capsys, key_files, monkeypatch):
    url = str(tmp_path / "ckpt")
    make_run(url, key_files["a"])
    forge_step(url, 3)
    code, out = run(capsys, "export", url, str(tmp_path / "out"), "--key", key_files["a_pub"])
    assert code == 0 and "exported step 2" in out, out
    module = nn.Linear(3, 2)
    assert distckpt.load_weights(url, module, verify_key=key_files["a_pub"]).step == 2
    monkeypatch.setenv(signing.VERIFY_ENV, key_files["a_pub"])
    assert distckpt.load_weights(url, module).step == 2
    monkeypatch.setenv(signing.VERIFY_ENV, key_files["b_pub"])
    with pytest.raises(distckpt.CorruptCheckpointError, match="verifies"):
        distckpt.load_weights(url, module)
    with pytest.raises(distckpt.ConfigError, match="verify_key"):
        distckpt.load_weights(str(tmp_path / "out"), module, verify_key=key_files["a_pub"])


def test_the_sign_command_refuses_its_arguments_without_importing_torch(tmp_path):
    code = ("import sys; from distckpt.tools import cli; rc = cli.main(['sign', '--help']) if False else None; "
            "sys.argv = ['distckpt']; "
            "import contextlib, io\n"
            "for argv in (['sign', '--help'], ['sign', 'x'], ['verify', '--help']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), "
            "contextlib.redirect_stderr(io.StringIO()):\n"
            "        cli.main(argv)\n"
            "assert 'torch' not in sys.modules and 'cryptography' not in sys.modules, 'heavy import'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

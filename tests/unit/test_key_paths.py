"""A key path that names no regular file — a FIFO, a directory, a device — is a ConfigError at once,
from the manager and from every command that takes a key (a FIFO held them in open() for ever); a
symbolic link to a key file is followed (mounted secrets are links)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import distckpt


def _key_file(tmp_path) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path = tmp_path / "key.pem"
    path.write_bytes(pem)
    return str(path)


def _not_a_file(tmp_path, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(tmp_path / "key")
        return str(tmp_path / "key")
    if kind == "directory":
        (tmp_path / "key").mkdir()
        return str(tmp_path / "key")
    return "/dev/null"


@pytest.mark.parametrize("kind", ["directory", "device"])
@pytest.mark.parametrize("argument", ["signing_key", "verify_key"])
def test_a_key_path_naming_no_regular_file_is_refused(tmp_path, kind, argument):
    with pytest.raises(distckpt.ConfigError, match="no regular file"):
        distckpt.CheckpointManager(str(tmp_path / "ckpt"), **{argument: _not_a_file(tmp_path, kind)})


def test_a_fifo_key_path_is_refused_at_once(tmp_path):
    """In a process of its own: a hang in open() must fail the test, not stop the run."""
    fifo = _not_a_file(tmp_path, "fifo")
    code = (f"import distckpt\ntry:\n    distckpt.CheckpointManager({str(tmp_path / 'ckpt')!r}, verify_key={fifo!r})\n"
            "except distckpt.ConfigError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "refused:" in out.stdout and "no regular file" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_the_commands_refuse_a_fifo_key_with_exit_2(tmp_path):
    with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(1, {"w": 1})
    fifo = _not_a_file(tmp_path, "fifo")
    command = [sys.executable, "-m", "distckpt", "verify", str(tmp_path / "ckpt"), "--key", fifo]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no regular file" in out.stderr, (out.returncode, out.stderr[-2000:])


def test_a_link_to_a_key_file_is_followed(tmp_path):
    os.symlink(_key_file(tmp_path), tmp_path / "linked.pem")
    with distckpt.CheckpointManager(str(tmp_path / "ckpt"), signing_key=str(tmp_path / "linked.pem")) as mgr:
        mgr.save(1, {"w": 1})
    assert (tmp_path / "ckpt" / "step-000000001" / "SIGNATURE").exists()

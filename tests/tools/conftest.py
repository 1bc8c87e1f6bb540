"""Fixtures of the command-line tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path, monkeypatch):
    """A checkpoint root on local disk, then in the session's S3 server (its credentials in the environment)."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    server = request.getfixturevalue("s3_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return request.getfixturevalue("s3_url")

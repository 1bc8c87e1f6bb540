from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
HERE = os.path.dirname(os.path.abspath(__file__))
# helper scripts and modules, and the test folders (a test module may reuse another's fixtures)
for _folder in ("helpers", "unit", "storage", "protocol", "distributed", "resume", "frameworks", "tools"):
    sys.path.insert(0, os.path.join(HERE, _folder))


def pytest_configure(config):
    """torch on one thread in the test process, as torchrun sets it for every rank: a load's
    copies then run on distckpt.io.copying's own threads (one per core), so every in-process load
    of the suite goes through them, not only the tests that ask for them."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def ckpt_dir(tmp_path):
    return str(tmp_path / "ckpt")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on free loopback ports, for the whole session."""
    from seaweed import SeaweedS3

    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweedfs"))).start()
    server.make_bucket("ckpt")
    yield server
    server.stop(grace_s=2)  # throwaway data: it lingered the whole 15 s on SIGTERM at the session's end


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A fake-gcs-server (Google Cloud Storage's JSON API) on a free loopback port."""
    from fakegcs import FakeGcs

    server = FakeGcs(str(tmp_path_factory.mktemp("fake-gcs"))).start()
    server.make_bucket("ckpt")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """Azurite's blob service (installed by `make install` with npm) on a free loopback port."""
    from azurite import Azurite

    server = Azurite(str(tmp_path_factory.mktemp("azurite"))).start()
    server.make_container("ckpt")
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3_server, request):
    """A fresh prefix in the test bucket."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40]
    return f"s3://ckpt/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def proxy(s3_server):
    """A fault-injecting HTTP proxy in front of the session's S3 server."""
    from faultproxy import FaultProxy

    p = FaultProxy(s3_server.s3_port).start()
    yield p
    p.stop()

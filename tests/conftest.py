from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ckpt_dir(tmp_path):
    return str(tmp_path / "ckpt")

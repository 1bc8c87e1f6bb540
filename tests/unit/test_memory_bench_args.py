"""bench/memory_tier.py's command line: shaped links need root, and say so before anything starts;
a malformed --links is refused by name."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("memory_tier_bench", os.path.join(ROOT, "bench", "memory_tier.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts bench/ and launch/ first
    spec.loader.exec_module(module)
    return module


def test_a_shaped_link_without_root_is_refused_before_anything_starts(bench, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("measured without root"))
    assert bench.main(["--links", "loopback,125", "--baseline", "none"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "--links loopback" in err, err


@pytest.mark.parametrize("links", ["fast", "0", "-5", ","])
def test_a_malformed_links_list_is_refused_by_name(bench, links, capsys):
    with pytest.raises(SystemExit):
        bench.parse(["--links", links])
    assert "--links" in capsys.readouterr().err

"""A local path is taken literally, whatever characters it holds ('::', '[', ']', '?', '#', '*',
'%', spaces, unicode): a root at runs/exp::v2 was read by fsspec as a chain and opened runs/exp,
another run's directory, whose checkpoint a new job loaded. Every place a root is named is checked
(CheckpointManager's url and local_dir, load_weights / export_weights, the command line, the
imports), with generated names (hypothesis, seeded and bounded); a URL with a scheme that fsspec
would read as a chain or a pattern is refused naming it."""

from __future__ import annotations

import os
import pathlib
import re
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt

EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40"))
ODD = ["::", ":", "[", "]", "[1]", "?", "#", "*", "%", "%20", " ", "é", "日本", "a::b", "::c", "?x=1", "#frag", "~"]
PLAIN = ["exp", "v2", "run", "1", "-", "_", "."]
ODD_CHARS = set("".join(ODD)) - set("".join(PLAIN)) - set("abcx=")
FORMS = ["absolute", "pathlib", "file-url", "relative"]

# A name begins with a plain piece (a leading '~' would be the home directory, '.' or '..' no
# name at all), then holds at least one odd piece.
names = st.tuples(st.sampled_from(["exp", "run", "v2", "1"]), st.sampled_from(ODD),
                  st.lists(st.sampled_from(ODD + PLAIN), max_size=4)).map(lambda t: t[0] + t[1] + "".join(t[2]))


def _root(parent: pathlib.Path, name: str, form: str):
    """The root as a user names it; "relative" is read from `parent` as the working directory."""
    return {"absolute": str(parent / name), "pathlib": parent / name, "file-url": f"file://{parent / name}",
            "relative": f"./{name}"}[form]


def _prefix(name: str) -> str:
    """The name cut at its first odd character: where a chain or a pattern read it (runs/exp for runs/exp::v2)."""
    cut = min((name.index(c) for c in ODD_CHARS if c in name), default=len(name))
    return name[:cut]


def _plain(name: str) -> str:
    return "".join(c for c in name if c not in ODD_CHARS)


class _InDirectory:
    def __init__(self, path: pathlib.Path) -> None:
        self.path, self.before = path, os.getcwd()

    def __enter__(self) -> None:
        os.chdir(self.path)

    def __exit__(self, *exc) -> None:
        os.chdir(self.before)


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value), "config": {"lr": 0.1}}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(name=names, form=st.sampled_from(FORMS))
def test_a_local_root_is_its_literal_path_whatever_it_holds(tmp_path_factory, name, form):
    """Save at the path, then a fresh manager at the same path loads that step; only that path
    was written; another run at the name cut at its first odd character is neither loaded nor
    touched, and a manager at the name without its odd characters sees nothing."""
    parent = pathlib.Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())) / "runs"
    parent.mkdir()
    other = _prefix(name) if _prefix(name) not in ("", name) else None
    if other is not None:  # another run beside it, where the chain reading of runs/exp::v2 landed
        with distckpt.CheckpointManager(str(parent / other)) as mgr:
            mgr.save(7, _state(7.0))
    root = _root(parent, name, form)
    with _InDirectory(parent):
        with distckpt.CheckpointManager(root) as mgr:
            state = _state(0.0)
            assert mgr.load_latest(state) is None, f"{root!r} loaded another run's checkpoint"
            mgr.save(3, _state(3.0))
        with distckpt.CheckpointManager(root) as mgr:
            progress = mgr.load_latest(state)
            assert progress is not None and progress.step == 3 and mgr.committed_steps() == [3]
    assert torch.equal(state["w"], torch.full((4,), 3.0))
    assert sorted(os.listdir(parent)) == sorted({name} | ({other} if other else set()))
    assert os.path.isdir(parent / name / "step-000000003")
    if other is not None:
        assert distckpt.CheckpointManager(str(parent / other)).committed_steps() == [7]
    plain = _plain(name)
    if plain and plain not in (name, other):
        assert distckpt.CheckpointManager(str(parent / plain)).committed_steps() == []
        assert distckpt.CheckpointManager(str(parent / plain)).load_latest(_state(0.0)) is None


@settings(max_examples=max(8, EXAMPLES // 4), deadline=None, derandomize=True)
@given(name=names)
def test_a_local_tier_weights_the_command_line_and_imports_take_odd_paths_literally(tmp_path_factory, name):
    """local_dir, export_weights' out_dir, load_weights' sources, the CLI's URL arguments and an
    import's destination: each writes and reads exactly the path it was given."""
    from distckpt.tools import cli

    base = pathlib.Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    durable, local, out, imported = (base / "d" / name, base / "l" / name, base / "e" / name, base / "i" / name)
    model = torch.nn.Linear(3, 2)
    with distckpt.CheckpointManager(str(durable), local_dir=str(local), durable_every=1) as mgr:
        mgr.save(5, {"model": model})
    for kept in (durable, local):
        assert os.listdir(kept.parent) == [name] and "step-000000005" in os.listdir(kept)
    assert cli.main(["ls", str(durable)]) == 0
    assert cli.main(["export", str(durable), str(out)]) == 0
    assert os.listdir(out.parent) == [name] and "model.safetensors" in os.listdir(out)
    for source in (durable, out, f"file://{out}"):
        back = torch.nn.Linear(3, 2)
        distckpt.load_weights(str(source), back)
        assert torch.equal(back.weight, model.weight)
    torch.save({"model": model.state_dict(), "step": 9}, base / "whole.pt")
    assert cli.main(["import-torch", str(base / "whole.pt"), str(imported), "--trust-pickle"]) == 0
    assert os.listdir(imported.parent) == [name]
    back = torch.nn.Linear(3, 2)
    distckpt.load_weights(str(imported), back)
    assert torch.equal(back.weight, model.weight)


REFUSED = [
    ("simplecache::s3://ckpt/x", "fsspec chain"), ("exp::v2", "fsspec chain"), ("s3://ckpt/a::b", "fsspec chain"),
    ("memory://runs/a::b", "fsspec chain"), ("memory://run[1]", "as a pattern"), ("s3://ckpt/run*", "as a pattern"),
    ("gs://ckpt/x?y", "as a pattern"), ("gs:///x", "names no bucket"), ("az:///x", "names no container"),
    ("exp:v2", "write ./exp:v2"),
]


@pytest.mark.parametrize("url, match", REFUSED)
def test_a_url_fsspec_would_read_as_a_chain_or_a_pattern_is_refused_everywhere(tmp_path, capsys, url, match):
    """Refused naming the URL and what to write instead, by the manager, load_weights and the CLI;
    as local_dir, as not a local path. Nothing is written anywhere."""
    from distckpt.tools import cli

    with pytest.raises(distckpt.ConfigError, match=re.escape(repr(url)) + ".*" + match):
        distckpt.CheckpointManager(url)
    with pytest.raises(distckpt.ConfigError, match=match):
        distckpt.load_weights(url, torch.nn.Linear(1, 1))
    with pytest.raises(distckpt.ConfigError, match="local_dir=.*must be a path on node-local disk"):
        distckpt.CheckpointManager(str(tmp_path / "run"), local_dir=url)
    assert cli.main(["ls", url]) == 2 and match.split()[-1] in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_chain_spelled_as_a_local_directory_is_that_directory(tmp_path, monkeypatch):
    """What the refusal says to write instead works: ./exp::v2 is the directory of that name."""
    monkeypatch.chdir(tmp_path)
    with distckpt.CheckpointManager("./exp::v2") as mgr:
        mgr.save(1, _state(1.0))
    assert os.listdir(tmp_path) == ["exp::v2"]
    assert distckpt.CheckpointManager(f"file://{tmp_path}/exp::v2").committed_steps() == [1]

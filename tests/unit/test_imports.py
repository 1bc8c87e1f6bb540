"""Existing checkpoints in: torch.save files and DCP directories become committed checkpoints
a job resumes from with load_latest; both are pickles, so the flag is required."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import distckpt
from distckpt.tools import cli
from distckpt.tools.importing import import_torch


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _assert_resumed(url, model, opt, step):
    fresh, fresh_opt = _fresh()
    with distckpt.CheckpointManager(url) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match="imported"):
            progress = mgr.load_latest({"model": fresh, "optimizer": fresh_opt})
        assert progress.step == step
        mgr.save(step + 1, {"model": fresh, "optimizer": fresh_opt})  # the resumed job goes on saving
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) and torch.equal(sa[i]["step"], sb[i]["step"]) for i in sa)


def test_a_torch_save_file_imports_and_resumes(tmp_path):
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 300, "epoch": 2}, tmp_path / "c.pt")
    assert cli.main(["import-torch", str(tmp_path / "c.pt"), str(tmp_path / "root"), "--trust-pickle"]) == 0
    assert cli.main(["verify", str(tmp_path / "root")]) == 0
    _assert_resumed(str(tmp_path / "root"), model, opt, 300)


def test_an_import_without_trust_is_refused_saying_why(tmp_path, capsys):
    model, opt = _trained()
    torch.save({"model": model.state_dict()}, tmp_path / "c.pt")
    assert cli.main(["import-torch", str(tmp_path / "c.pt"), str(tmp_path / "root")]) == 2
    assert "is a pickle" in capsys.readouterr().err
    assert not (tmp_path / "root").exists()


def test_a_dcp_checkpoint_imports_and_resumes(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, opt = _trained()
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    assert cli.main(["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "root"), "--trust-pickle",
                     "--step", "40"]) == 0
    _assert_resumed(str(tmp_path / "root"), model, opt, 40)


def test_an_import_for_two_ranks_is_loadable_by_a_two_rank_job(tmp_path):
    model, opt = _trained()
    torch.save({"model": model.state_dict()}, tmp_path / "c.pt")
    from distckpt.tools.importing import import_torch

    import_torch(str(tmp_path / "c.pt"), str(tmp_path / "root"), trust_pickle=True, world_size=2)
    import json

    manifest = json.load(open(tmp_path / "root" / "step-000000000" / "manifest.json"))
    assert manifest["world_size"] == 2 and manifest["imported"].startswith("torch.save")


@pytest.mark.parametrize("value, expected", [(torch.tensor(1500), 1500), (7, 7), (-5, None), ("abc", None),
                                             (3.7, None), (torch.tensor(2.5), None), (True, None),
                                             (np.int64(42), 42), (np.int32(9), 9), (np.float64(2.0), None),
                                             (2**63 - 1, 2**63 - 1), (2**63, None), (2**70, None)])
def test_the_sources_step_is_taken_or_refused_never_replaced_by_0(tmp_path, value, expected):
    file = str(tmp_path / "src.pt")
    torch.save({"model": nn.Linear(2, 2).state_dict(), "step": value}, file)
    url = str(tmp_path / "ckpt")
    if expected is None:
        with pytest.raises(distckpt.ConfigError, match="'step' is .* not a step number"):
            import_torch(file, url, trust_pickle=True)
        assert cli.main(["import-torch", file, url, "--trust-pickle"]) == 2
        assert cli.main(["import-torch", file, url, "--trust-pickle", "--step", "3"]) == 0  # told which
    else:
        assert import_torch(file, url, trust_pickle=True) == expected


def test_an_import_never_joins_another_runs_root_and_damaged_sources_are_clean_errors(tmp_path, capsys):
    import json

    file = str(tmp_path / "src.pt")
    torch.save({"model": nn.Linear(2, 2).state_dict()}, file)
    url = str(tmp_path / "ckpt")
    assert cli.main(["import-torch", file, url, "--trust-pickle", "--step", "3"]) == 0
    for step in ("4", "3"):  # another step of the same root is refused too: one run per root
        assert cli.main(["import-torch", file, url, "--trust-pickle", "--step", step]) == 2
    assert distckpt.CheckpointManager(url).committed_steps() == [3]
    for world in ("0", "1000000"):  # one file per rank: a bound, not a GiB and minutes of rank files
        assert cli.main(["import-torch", file, str(tmp_path / "w"), "--trust-pickle", "--world-size", world]) == 2
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"garbage")
    capsys.readouterr()
    for command in (["import-torch", str(empty)], ["import-dcp", str(tmp_path / "emptydir")],
                    ["import-dcp", str(empty)], ["import-dcp", str(tmp_path / "dcp")]):
        assert cli.main([*command, str(tmp_path / "new"), "--trust-pickle", "--json"]) == 2, command
        out = capsys.readouterr().out
        assert json.loads(out)["exit_code"] == 2  # exactly one JSON document
        assert not (tmp_path / "new").exists() or not distckpt.CheckpointManager(str(tmp_path / "new")).committed_steps()


def test_numpy_scalars_come_through_the_restricted_unpickler_and_arrays_stay_refused(tmp_path):
    file, url = str(tmp_path / "src.pt"), str(tmp_path / "ckpt")
    torch.save({"model": nn.Linear(2, 2).state_dict(), "step": np.int64(7), "best": {"loss": np.float32(0.25)}}, file)
    assert import_torch(file, url, trust_pickle=True) == 7
    state = {"model": nn.Linear(2, 2), "best": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", distckpt.CheckpointFallbackWarning)
        assert distckpt.CheckpointManager(url).load_latest(state).step == 7
    assert type(state["best"]["loss"]) is np.float32 and state["best"]["loss"] == np.float32(0.25)
    torch.save({"model": nn.Linear(2, 2).state_dict(), "array": np.zeros(3)}, file)
    with pytest.raises(distckpt.UnstorableValueError, match="not a torch.save file of tensors") as raised:
        import_torch(file, str(tmp_path / "other"), trust_pickle=True)
    assert "\x1b[" not in str(raised.value)  # torch's terminal emphasis left out of the message


def test_an_imported_checkpoint_is_inspected_exported_and_loaded_as_weights(tmp_path, capsys):
    """inspect of any imported step failed ("a tree does not have the structure distckpt writes":
    its rank file holds no RNG streams), and export / load_weights found no module entry in it
    (an imported model is the state_dict as saved)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    file = str(tmp_path / "t.pt")
    torch.save({"model": model.state_dict(), "step": 5}, file)
    url = str(tmp_path / "root")
    assert cli.main(["import-torch", file, url, "--trust-pickle"]) == 0
    assert cli.main(["inspect", url]) == 0
    assert "rank 0" in capsys.readouterr().out
    assert cli.main(["export", url, str(tmp_path / "hf")]) == 0
    fresh = nn.Linear(3, 2)
    report = distckpt.load_weights(url, fresh)
    assert report.step == 5 and not report.missing and not report.unexpected
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    with pytest.raises(distckpt.IncompatibleCheckpointError, match=r"no module entry 'step' \(module entries: \['model'\]\)"):
        distckpt.load_weights(url, nn.Linear(3, 2), entry="step")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "directory", "link-to-fifo"])
def test_a_source_that_is_not_a_regular_file_is_refused_and_nothing_waits(tmp_path, capsys, kind):
    import os

    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)  # a read of it would wait for a writer for ever
    source = {"fifo": fifo, "directory": str(tmp_path), "link-to-fifo": str(tmp_path / "link.pt")}[kind]
    if kind == "link-to-fifo":
        os.symlink(fifo, source)
    root = str(tmp_path / "root")
    with pytest.raises(distckpt.ConfigError, match="not a regular file"):
        import_torch(source, root, trust_pickle=True)
    assert cli.main(["import-torch", source, root, "--trust-pickle"]) != 0
    assert "not a regular file" in capsys.readouterr().err
    assert not os.path.exists(root)
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    os.mkfifo(str(dcp / "__0_0.distcp"))
    with pytest.raises(distckpt.ConfigError, match="__0_0.distcp is not a regular file"):
        distckpt.tools.importing.import_dcp(str(dcp), root, trust_pickle=True)

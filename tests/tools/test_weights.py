"""Weights out and in: `distckpt export` to Hugging Face safetensors and `distckpt.load_weights`
from a distckpt root (any world size) or an exported directory."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import distckpt
from distckpt.tools import cli

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # the helper scripts


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.embed.weight  # tied


def _trained(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _save(root: str, model: nn.Module) -> None:
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load_latest({"model": model})
        mgr.save(3, {"model": model, "config": {"lr": 0.1}})


@pytest.mark.parametrize("wrap", ["bare", "compiled"])
def test_export_writes_bare_keys_that_load_bitwise_into_a_fresh_module(tmp_path, wrap):
    model = _trained()
    stored = torch.compile(model, backend="eager") if wrap == "compiled" else model
    _save(str(tmp_path / "ckpt"), stored)
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--json"]) == 0
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    expected = model.state_dict()
    assert sorted(tensors) == sorted(expected)  # no module. / _orig_mod. prefixes, tied key present
    for k, v in expected.items():
        assert torch.equal(tensors[k], v), k
    fresh = TinyLM()
    report = distckpt.load_weights(str(tmp_path / "hf"), fresh)
    assert not report.missing and not report.unexpected
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_export_in_shards_writes_a_correct_index(tmp_path):
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    summary = distckpt.export_weights(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size="5KB")
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == sorted(f for f in summary.files if f.endswith(".safetensors"))
    sizes = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / "hf" / file))[name], model.state_dict()[name])
    fresh = TinyLM()
    distckpt.load_weights(str(tmp_path / "hf"), fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_export_casts_floating_point_tensors_on_request(tmp_path):
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    distckpt.export_weights(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype="bf16")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["norm.weight"], model.norm.weight.detach().to(torch.bfloat16))


def test_load_weights_from_a_checkpoint_needs_no_process_group_and_is_strict(tmp_path):
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    fresh = TinyLM()
    report = distckpt.load_weights(str(tmp_path / "ckpt"), fresh)
    assert report.step == 3 and sorted(report.loaded) == sorted(model.state_dict())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    other = nn.Sequential(nn.Linear(16, 16))
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="unexpected"):
        distckpt.load_weights(str(tmp_path / "ckpt"), other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # nothing changed


def test_load_weights_maps_prefixes_and_ignores_patterns(tmp_path):
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    wrapper = nn.Module()
    wrapper.backbone = TinyLM()
    wrapper.head = nn.Linear(16, 2)
    report = distckpt.load_weights(str(tmp_path / "ckpt"), wrapper, prefix_map={"": "backbone."},
                                   ignore=["head.*"], strict=True)
    assert torch.equal(wrapper.backbone.norm.weight, model.norm.weight)
    assert report.missing == [] and "head.weight" not in report.loaded


def test_a_damaged_checkpoint_refuses_to_export(tmp_path):
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    step_dir = tmp_path / "ckpt" / "step-000000003" / "replicated"
    payload = next(step_dir.iterdir())
    data = bytearray(payload.read_bytes())
    data[-5] ^= 0xFF
    payload.write_bytes(bytes(data))
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.faults  # make test-faults; make test exports trained 2-rank DDP and FSDP2 checkpoints below
def test_an_fsdp2_checkpoint_of_two_ranks_exports_whole(tmp_path):
    sys.path.insert(0, HERE)
    from zoo import torchrun

    result = torchrun(2, ["--ckpt", str(tmp_path / "ckpt"), "--loss-log", str(tmp_path / "log"), "--wrap", "fsdp2",
                          "--steps", "5", "--every", "5"], 0)
    assert result.returncode == 0, result.stderr[-3000:]
    from zoo_loop import Net

    whole = Net()  # the reference: the manager's own 2 -> 1 reshard into a plain model
    with distckpt.CheckpointManager(str(tmp_path / "ckpt"), world_size_policy="reshard") as mgr:
        with pytest.warns(UserWarning):
            mgr.load_latest({"model": whole})
    fresh = Net()
    report = distckpt.load_weights(str(tmp_path / "ckpt"), fresh)
    assert not report.missing and not report.unexpected
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in whole.state_dict().items())
    distckpt.export_weights(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(tensors) == sorted(whole.state_dict())
    for k, v in whole.state_dict().items():
        assert torch.equal(tensors[k], v), k
    assert tensors["fc1.weight"].shape == (16, 8)  # whole, not one rank's shard


@pytest.mark.parametrize("wrap,ranks", [("ddp", 2), ("fsdp2", 2), pytest.param("fsdp2", 4, marks=pytest.mark.faults)])
def test_export_of_a_trained_multi_rank_checkpoint_equals_the_trained_weights(tmp_path, wrap, ranks):
    sys.path.insert(0, HERE)
    from zoo import torchrun

    dump = str(tmp_path / "trained.pt")
    result = torchrun(ranks, ["--ckpt", str(tmp_path / "ckpt"), "--loss-log", str(tmp_path / "log"), "--wrap", wrap,
                              "--steps", "10", "--every", "5", "--dump-weights", dump], 0)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = torch.load(dump, weights_only=True)  # what training ended with, gathered whole
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(trained)  # bare keys: no "module."
    for k, v in trained.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    from zoo_loop import Net

    fresh = Net()
    report = distckpt.load_weights(str(tmp_path / "ckpt"), fresh)
    assert not report.missing and not report.unexpected and report.step == 9
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.items())
    if wrap != "fsdp2":
        return
    # The last rank's shard file of step 9 damaged: found while the step is chosen, so export and
    # load_weights take step 4 whole (they failed, and load_weights had copied rank 0's tensors).
    shards = os.path.join(str(tmp_path / "ckpt"), "step-000000009", "shards")
    damaged = os.path.join(shards, sorted(os.listdir(shards))[-1])
    data = bytearray(open(damaged, "rb").read())
    data[-3] ^= 0xFF
    open(damaged, "wb").write(bytes(data))
    older = Net()
    assert distckpt.load_weights(str(tmp_path / "ckpt"), older).step == 4
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in older.state_dict().items())
    assert not all(torch.equal(back[k], v) for k, v in trained.items())


EXPORT_IN_A_CHILD = r"""
import json, sys, distckpt
from distckpt.tools.weights import export_weights

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS")
summary = export_weights(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
print(json.dumps({"peak_extra": status("VmHWM") - before, "files": summary.files}))
"""


@pytest.mark.faults  # writes a 1 GiB checkpoint; make test-faults
def test_export_of_a_1_gib_model_stays_within_one_shard_and_one_tensor(tmp_path):
    import json
    import subprocess
    import sys

    tensor_mib, count, shard_mib = 64, 16, 256
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.full((tensor_mib << 18,), float(i)))
                                    for i in range(count)])
    url = str(tmp_path / "ckpt")
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"model": model})
    del model
    out = subprocess.run([sys.executable, "-c", EXPORT_IN_A_CHILD, url, str(tmp_path / "out"), f"{shard_mib}MB"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["files"]) == 7  # three 64 MiB tensors fit in 256 MB: 6 shards, and the index
    bound = (shard_mib + tensor_mib + 128) << 20  # one output shard + one tensor + a margin
    print(f"export of {count * tensor_mib} MiB: peak extra RSS {report['peak_extra'] >> 20} MiB (bound {bound >> 20})")
    assert report["peak_extra"] < bound, (report["peak_extra"] >> 20, bound >> 20)
    from safetensors import safe_open

    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == count * (tensor_mib << 20)
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / "out" / file), framework="pt") as f:
            t = f.get_tensor(name)
        assert torch.equal(t, torch.full((tensor_mib << 18,), float(int(name))))


def _bytes_of(module: nn.Module) -> dict[str, bytes]:
    return {k: bytes(v.detach().contiguous().view(torch.uint8).reshape(-1).numpy()) if v.numel() else b""
            for k, v in module.state_dict().items()}


class Untied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.z = nn.Linear(4, 4)


@pytest.mark.parametrize("kind", ["expanded", "inference", "meta", "tied-differently"])
def test_load_weights_refuses_before_changing_anything(tmp_path, kind):
    """Every check passes before any parameter changes: a parameter that cannot take the copy
    (expanded, an inference tensor, on the meta device) or two different source tensors into one
    tied parameter used to raise half-way (or report a meta model loaded, or keep one silently)."""
    torch.manual_seed(1)
    if kind == "tied-differently":
        source = Untied()  # a.weight and z.weight differ in the checkpoint; tied here
        module = Untied()
        module.z.weight = module.a.weight
    else:
        source = Untied()
        if kind == "meta":
            with torch.device("meta"):
                module = Untied()
        elif kind == "inference":
            with torch.inference_mode():
                module = Untied()
        else:
            module = Untied()
            module.z.bias = nn.Parameter(torch.zeros(1).expand(4))  # one value seen four times
    _save(str(tmp_path / "ckpt"), source)
    before = None if kind == "meta" else _bytes_of(module)
    with pytest.raises(distckpt.IncompatibleCheckpointError):
        distckpt.load_weights(str(tmp_path / "ckpt"), module)
    if before is not None:
        assert _bytes_of(module) == before


def test_load_weights_checks_its_patterns_and_refuses_renames_onto_one_key(tmp_path):
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    before = _bytes_of(model)
    with pytest.raises(distckpt.ConfigError, match="ignore="):
        distckpt.load_weights(str(tmp_path / "ckpt"), model, ignore="lm_head.*")  # each character a pattern
    with pytest.raises(distckpt.ConfigError, match="prefix_map="):
        distckpt.load_weights(str(tmp_path / "ckpt"), model, prefix_map={1: "x"})
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="both map to"):
        distckpt.load_weights(str(tmp_path / "ckpt"), model, prefix_map={"block.0.": "block.2.", "block.2.": "block.2."},
                              strict=False)
    assert _bytes_of(model) == before


def _weight_of(path: str) -> float:
    return float(load_file(path)["weight"].flatten()[0])


def test_export_and_load_weights_skip_a_superseded_writers_steps_as_load_latest_does(tmp_path, capsys):
    """Incarnation 1 committed steps 0-3; incarnation 2 resumed from step 0 and committed step 1:
    steps 2 and 3 are a superseded writer's. export and load_weights took step 3."""
    root = str(tmp_path / "ckpt")
    model = nn.Linear(2, 1, bias=False)
    with distckpt.CheckpointManager(root) as first:
        first.load_latest({"model": model})
        for step in range(4):
            with torch.no_grad():
                model.weight.fill_(step)
            first.save(step, {"model": model})
    with distckpt.CheckpointManager(root) as second:
        second.load({"model": model}, step=0)
        with torch.no_grad():
            model.weight.fill_(100)
        with warnings.catch_warnings():  # below the superseded steps 2 and 3, but no branch: load_latest takes 1
            warnings.simplefilter("error", distckpt.CheckpointWarning)
            second.save(1, {"model": model})
    assert distckpt.CheckpointManager(root).load_latest({"model": nn.Linear(2, 1, bias=False)}).step == 1
    fresh = nn.Linear(2, 1, bias=False)
    assert distckpt.load_weights(root, fresh).step == 1 and float(fresh.weight[0, 0]) == 100.0
    assert cli.main(["export", root, str(tmp_path / "hf")]) == 0
    assert _weight_of(str(tmp_path / "hf" / "model.safetensors")) == 100.0
    capsys.readouterr()
    assert cli.main(["inspect", root, "--json"]) == 0  # inspect without --step shows that step too
    assert json.loads(capsys.readouterr().out)["manifest"]["step"] == 1


@pytest.mark.parametrize("damage", ["flip_replicated", "truncate_rank_file", "remove_manifest", "directory_for_payload",
                                    "symlink_for_payload", "truncate_replicated"])
def test_export_and_load_weights_choose_the_step_load_latest_chooses(tmp_path, damage, capsys):
    """A damaged newest step: export exported it (a truncated rank file) or stopped (a missing
    manifest) while load_latest took the previous step."""
    import shutil

    root = str(tmp_path / "ckpt")
    model = nn.Linear(2, 1, bias=False)
    with distckpt.CheckpointManager(root) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(step, {"model": model})
    step_dir = os.path.join(root, "step-000000002")
    replicated = os.path.join(step_dir, "replicated", os.listdir(os.path.join(step_dir, "replicated"))[0])
    rank_file = os.path.join(step_dir, "ranks", os.listdir(os.path.join(step_dir, "ranks"))[0])
    if damage == "flip_replicated":
        data = bytearray(open(replicated, "rb").read())
        data[-5] ^= 0xFF
        open(replicated, "wb").write(bytes(data))
    elif damage == "truncate_rank_file":
        open(rank_file, "r+b").truncate(100)
    elif damage == "remove_manifest":
        os.remove(os.path.join(step_dir, "manifest.json"))
    elif damage == "symlink_for_payload":  # an error of the storage layer (ELOOP), still damage
        shutil.move(replicated, str(tmp_path / "elsewhere"))
        os.symlink(str(tmp_path / "elsewhere"), replicated)
    elif damage == "truncate_replicated":
        open(replicated, "r+b").truncate(100)
    else:
        os.remove(replicated)
        os.makedirs(replicated)
    with pytest.warns(distckpt.CheckpointFallbackWarning):
        assert distckpt.CheckpointManager(root).load_latest({"model": nn.Linear(2, 1, bias=False)}).step == 1
    fresh = nn.Linear(2, 1, bias=False)
    assert distckpt.load_weights(root, fresh).step == 1 and float(fresh.weight[0, 0]) == 1.0
    assert cli.main(["export", root, str(tmp_path / "hf")]) == 0
    assert _weight_of(str(tmp_path / "hf" / "model.safetensors")) == 1.0
    shutil.rmtree(tmp_path / "hf")
    assert cli.main(["export", root, str(tmp_path / "hf"), "--step", "2"]) == 2  # asked for: refused
    # inspect without --step describes the step they chose (it failed on a truncated newest step),
    # and exits 1 when it passed over the damaged newest one (it exited 0, as if all were well)
    capsys.readouterr()
    code = cli.main(["inspect", root, "--json"])
    described = json.loads(capsys.readouterr().out)["manifest"]["step"]
    # inspect verifies what it describes as a load does: a flipped payload byte is passed over too
    assert (code, described) == (1, 1), (code, described)


def test_an_export_into_a_step_directory_of_a_root_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    _save(root, _trained())
    for inside in ("step-000000003", "step-000000009", "step-000000003/deeper", "fence"):
        assert cli.main(["export", root, os.path.join(root, inside)]) == 2, inside
    assert sorted(os.listdir(root)) == ["fence", "step-000000003"]
    assert not os.path.exists(os.path.join(root, "step-000000003", "model.safetensors"))
    assert cli.main(["export", root, os.path.join(root, "hf")]) == 0  # beside the steps: the user's own


def test_an_export_never_mixes_with_a_checkpoint_root_or_an_earlier_export(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    first = _trained(0)
    _save(root, first)
    assert cli.main(["export", root, root]) == 2  # into the run directory: refused
    assert not os.path.exists(os.path.join(root, "model.safetensors"))
    assert cli.main(["export", root, out, "--max-shard-size", "2KB"]) == 0
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    second = _trained(1)
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load_latest({"model": _trained(5), "config": {}})
        mgr.save(4, {"model": second, "config": {"lr": 0.1}})
    assert cli.main(["export", root, out]) == 0  # one file now: the earlier shards and index go
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    fresh = TinyLM()
    distckpt.load_weights(out, fresh)
    assert _bytes_of(fresh) == _bytes_of(second)
    with pytest.raises(distckpt.ConfigError, match="step="):
        distckpt.load_weights(out, TinyLM(), step=3)
    import shutil

    shutil.copy(os.path.join(out, "model.safetensors"), os.path.join(root, "model.safetensors"))
    with pytest.raises(distckpt.ConfigError, match="ambiguous"):
        distckpt.load_weights(root, TinyLM(), step=3)


@pytest.mark.parametrize("fail_at", [1, 2, "index", "move"])
def test_an_export_failing_half_way_leaves_the_earlier_export_whole(tmp_path, monkeypatch, fail_at):
    """A sharded export of another step into the same directory fails at its Nth shard, its index
    or while moving files into place: the earlier export is still there byte for byte, no temporary
    file is left (each shard used to replace the old one as it was written: two steps, one index)."""
    from distckpt.tools import exporting
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"model": _trained(0)})
        mgr.save(2, {"model": _trained(1)})
    assert cli.main(["export", root, out, "--step", "1", "--max-shard-size", "2KB"]) == 0
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    assert len(before) > 3
    real_write, real_synced, real_replace = exporting.write_shard, exporting.write_synced, os.replace
    calls = {"shard": 0, "move": 0}

    def write_shard(*args, **kwargs):
        calls["shard"] += 1
        if calls["shard"] == fail_at:
            raise OSError(28, "No space left on device")
        return real_write(*args, **kwargs)

    def write_synced(*args, **kwargs):
        if fail_at == "index":
            raise OSError(28, "No space left on device")
        return real_synced(*args, **kwargs)

    def replace(src, dst):
        calls["move"] += 1
        if fail_at == "move" and calls["move"] == 1:
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(exporting, "write_shard", write_shard)
    monkeypatch.setattr(exporting, "write_synced", write_synced)
    monkeypatch.setattr(exporting.os, "replace", replace)
    assert cli.main(["export", root, out, "--step", "2", "--max-shard-size", "2KB"]) == 2
    monkeypatch.undo()
    after = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    assert after == before
    fresh = TinyLM()
    distckpt.load_weights(out, fresh)
    assert _bytes_of(fresh) == _bytes_of(_trained(0))


def test_a_hugging_face_file_with_a_dtype_distckpt_does_not_load_or_a_wrong_index_is_refused(tmp_path):
    from safetensors.torch import save_file

    model = nn.Linear(2, 1, bias=False)
    os.makedirs(tmp_path / "c64")
    save_file({"weight": torch.tensor([[1 + 2j, 3 + 4j]], dtype=torch.complex64)},
              str(tmp_path / "c64" / "model.safetensors"))
    before = model.weight.detach().clone()
    for allow_cast in (True, False):  # complex into float32 used to be read as float32, dropping the imaginary part
        with pytest.raises(distckpt.IncompatibleCheckpointError, match="C64"):
            distckpt.load_weights(str(tmp_path / "c64"), model, allow_cast=allow_cast)
    assert torch.equal(model.weight.detach(), before)
    os.makedirs(tmp_path / "idx")
    save_file({"weight": torch.ones(1, 2)}, str(tmp_path / "idx" / "model-00001-of-00001.safetensors"))
    index = {"metadata": {"total_size": 8}, "weight_map": {"weight": "model-00001-of-00001.safetensors",
                                                           "bias": "model-00001-of-00001.safetensors"}}
    open(tmp_path / "idx" / "model.safetensors.index.json", "w").write(json.dumps(index))
    with pytest.raises(distckpt.CorruptCheckpointError, match="bias"):  # was a bare KeyError
        distckpt.load_weights(str(tmp_path / "idx"), nn.Linear(2, 1))


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    _save(root, _trained())
    assert cli.main(["export", root, out, "--max-shard-size", "2KB"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    from safetensors.torch import save_file

    name = next(k for k, v in index["weight_map"].items() if v == files[0])
    extra = load_file(os.path.join(out, files[1]))
    extra[name] = torch.zeros_like(load_file(os.path.join(out, files[0]))[name])
    save_file(extra, os.path.join(out, files[1]))
    with pytest.raises(distckpt.CorruptCheckpointError, match="in two shards"):
        distckpt.load_weights(out, TinyLM())


def test_a_tied_weight_saved_once_as_hugging_face_does_loads_strictly(tmp_path):
    """save_pretrained writes a tied lm_head once: the key tied to a filled one is not missing."""
    from safetensors.torch import save_file

    model = _trained()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    fresh = TinyLM()
    report = distckpt.load_weights(str(tmp_path), fresh)
    assert report.missing == [] and "lm_head.weight" not in report.loaded
    assert torch.equal(fresh.lm_head.weight, model.embed.weight)
    untied = TinyLM()
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="missing \\['lm_head.weight'\\]"):
        distckpt.load_weights(str(tmp_path), untied)


def test_an_unreadable_export_is_a_distckpt_error_naming_it(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    _save(root, _trained())
    assert cli.main(["export", root, out, "--max-shard-size", "2KB"]) == 0
    shard = os.path.join(out, sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))[-1])
    data = open(shard, "rb").read()
    for damage in (data[:-5], b"\xff" * 100, b""):
        open(shard, "wb").write(damage)
        with pytest.raises(distckpt.CorruptCheckpointError, match="not readable as safetensors"):
            distckpt.load_weights(out, TinyLM())
    os.remove(shard)
    with pytest.raises(distckpt.MissingFileError, match="incomplete"):
        distckpt.load_weights(out, TinyLM())


class LegacyNamed(nn.Module):
    """Checkpoints of an older version named its weight `w`: a load_state_dict pre-hook renames it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 3))
        self._register_load_state_dict_pre_hook(self._rename)

    @staticmethod
    def _rename(state_dict, prefix, *args):
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")


class Transposing(nn.Module):
    """Its own _load_from_state_dict converts what it is given (a stored transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, 4))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if key in state_dict and state_dict[key].shape == (4, 3):
            state_dict[key] = state_dict[key].t().contiguous()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class WithLoaders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.legacy = LegacyNamed()
        self.conv = Transposing()
        self.head = nn.Linear(3, 2)


@pytest.mark.parametrize("through", ["export", "checkpoint"])
def test_modules_with_loading_code_of_their_own_load_as_load_state_dict_would(tmp_path, through):
    """Copying tensor by tensor skipped a module's hooks and _load_from_state_dict: a legacy key
    was 'unexpected', a stored transpose refused by shape. Now the module's own load_state_dict
    runs, and a load it refuses leaves every tensor as it was."""
    torch.manual_seed(0)
    source = {"legacy.w": torch.randn(4, 3), "conv.weight": torch.randn(4, 3),
              "head.weight": torch.randn(2, 3), "head.bias": torch.randn(2)}
    if through == "export":
        from safetensors.torch import save_file
        (tmp_path / "hf").mkdir()
        save_file(source, str(tmp_path / "hf" / "model.safetensors"))
        where = str(tmp_path / "hf")
    else:
        older = nn.Module()  # the older version's module: the names the source holds
        older.legacy, older.conv, older.head = nn.Module(), nn.Module(), nn.Linear(3, 2)
        older.legacy.w, older.conv.weight = nn.Parameter(source["legacy.w"]), nn.Parameter(source["conv.weight"])
        older.head.load_state_dict({"weight": source["head.weight"], "bias": source["head.bias"]})
        with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
            mgr.save(1, {"model": older})
        where = str(tmp_path / "ckpt")
    expected = WithLoaders()
    expected.load_state_dict({k: v.clone() for k, v in source.items()})
    model = WithLoaders()
    report = distckpt.load_weights(where, model)
    assert not report.missing and not report.unexpected, report
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key

    before = {k: v.clone() for k, v in WithLoaders().state_dict().items()}
    fresh = WithLoaders()
    fresh.load_state_dict(before)
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="left as it was"):
        distckpt.load_weights(where, fresh, ignore=["head.bias"])  # strict: head.bias missing
    for key, value in before.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    report = distckpt.load_weights(where, fresh, ignore=["head.bias"], strict=False)
    assert report.missing == ["head.bias"] and torch.equal(fresh.head.weight, source["head.weight"])


@pytest.mark.parametrize("call, name", [
    (lambda root, out, m: distckpt.load_weights(root, m, step=False), "step="),
    (lambda root, out, m: distckpt.load_weights(root, m, step=1.5), "step="),
    (lambda root, out, m: distckpt.load_weights(root, m, step=torch.ones(2)), "step="),
    (lambda root, out, m: distckpt.load_weights(root, m, entry=["model"]), "entry="),
    (lambda root, out, m: distckpt.export_weights(root, None), "out_dir="),
    (lambda root, out, m: distckpt.export_weights(root, ""), "out_dir="),
    (lambda root, out, m: distckpt.export_weights(root, 2**70), "out_dir="),
    (lambda root, out, m: distckpt.export_weights(root, out, step=True), "step="),
    (lambda root, out, m: distckpt.export_weights(root, out, entry={}), "entry="),
    (lambda root, out, m: distckpt.export_weights(root, out, progress=None), "progress="),
    (lambda root, out, m: distckpt.export_weights(root, out, max_shard_size=1.5), "max_shard_size="),
])
def test_weights_arguments_are_checked_naming_them(tmp_path, call, name):
    """step=False loaded step 0; others were bare TypeErrors / RuntimeErrors."""
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    with pytest.raises(distckpt.ConfigError, match=name):
        call(str(tmp_path / "ckpt"), str(tmp_path / "out"), TinyLM())
    assert not (tmp_path / "out").exists()


class WithAChildNamedOrigMod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._orig_mod = nn.Linear(2, 2)  # torch.compile's attribute name, on a module that is no wrapper
        self.body = nn.Linear(2, 3)


def test_a_child_named_like_the_compile_wrappers_attribute_is_no_wrapper(tmp_path):
    """Taken for torch.compile's wrapper, only that child was saved, exported and loaded, silently."""
    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = WithAChildNamedOrigMod()
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model})
    resumed = WithAChildNamedOrigMod()
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load_latest({"model": resumed})
    assert _bytes_of(resumed) == _bytes_of(model)
    fresh = WithAChildNamedOrigMod()
    report = distckpt.load_weights(root, fresh)
    assert _bytes_of(fresh) == _bytes_of(model) and "body.weight" in report.loaded
    assert cli.main(["export", root, str(tmp_path / "hf")]) == 0
    assert sorted(load_file(str(tmp_path / "hf" / "model.safetensors"))) == sorted(model.state_dict())


def test_export_and_load_weights_take_a_file_url_as_the_path_it_names(tmp_path, monkeypatch):
    """export into file:///abs/out wrote under ./file:/abs/out (exit 0), and load_weights of an
    exported directory given as file:// looked for a checkpoint root there; an object-store
    out_dir and a file as out_dir are refused, naming out_dir."""
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "hf"
    assert cli.main(["export", str(tmp_path / "ckpt"), f"file://{out}"]) == 0
    assert (out / "model.safetensors").is_file() and not (tmp_path / "file:").exists()
    fresh = TinyLM()
    report = distckpt.load_weights(f"file://{out}", fresh)
    assert not report.missing and not report.unexpected
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    with pytest.raises(distckpt.ConfigError, match="out_dir='s3://bucket/x'.*local directory"):
        distckpt.export_weights(str(tmp_path / "ckpt"), "s3://bucket/x")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(distckpt.ConfigError, match="out_dir=.*afile' is a file"):
        distckpt.export_weights(str(tmp_path / "ckpt"), str(tmp_path / "afile"))


def test_a_shape_refusal_under_strict_false_does_not_advise_strict_false(tmp_path):
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    other = TinyLM()
    other.norm = nn.LayerNorm(8)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="norm.weight") as err:
        distckpt.load_weights(str(tmp_path / "ckpt"), other, strict=False)
    assert "strict=False" not in str(err.value) and "ignore=" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("case", ["ignore everything", "ignore every source key", "prefix differs",
                                  "prefix differs, module with loading code"])
def test_a_load_that_would_copy_no_tensor_is_refused_and_changes_nothing(tmp_path, case, strict):
    """`ignore=["*"]` under strict=True, or a source whose keys all carry another prefix under
    strict=False, loaded nothing and returned a report as for a load: the module kept its values
    and the caller had no error to read. Refused now, with either strict, naming the keys."""
    model = _trained()
    _save(str(tmp_path / "ckpt"), model)
    if case == "prefix differs, module with loading code":
        fresh: nn.Module = WithLoaders()
        from safetensors.torch import save_file
        (tmp_path / "hf").mkdir()
        save_file({"module." + k: v.clone() for k, v in WithLoaders().state_dict().items()},
                  str(tmp_path / "hf" / "model.safetensors"))
        where = str(tmp_path / "hf")
    else:
        fresh, where = TinyLM(), str(tmp_path / "ckpt")
    kwargs: dict = {"strict": strict}
    if case == "ignore everything":
        kwargs["ignore"] = ["*"]
    elif case == "ignore every source key":
        kwargs["ignore"] = [k for k in model.state_dict()]
    else:
        kwargs["prefix_map"] = {"": "model."} if case == "prefix differs" else None
    before = _bytes_of(fresh)
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="does not fit the module") as err:
        distckpt.load_weights(where, fresh, **{k: v for k, v in kwargs.items() if v is not None})
    if not strict or "loading code" not in case:  # (torch's own strict refusal names the keys otherwise)
        assert "not one of the module's" in str(err.value) and "would be loaded" in str(err.value)
    assert _bytes_of(fresh) == before
    if case == "ignore everything":  # one key left in is a load
        keep = sorted(model.state_dict())[0]
        report = distckpt.load_weights(where, fresh, strict=False, ignore=[k for k in model.state_dict() if k != keep])
        assert report.loaded == [keep]


def test_a_root_behind_a_dangling_link_is_said_as_such_by_load_weights_and_export(tmp_path):
    """load_latest said "a symbolic link to ... which does not exist (a volume not mounted on this
    node?)"; load_weights and export said "no committed checkpoint", which reads as a run that
    never saved."""
    (tmp_path / "root").symlink_to(tmp_path / "not-mounted")
    with pytest.raises(distckpt.StorageError, match="symbolic link to .*which does not exist"):
        distckpt.load_weights(str(tmp_path / "root"), TinyLM())
    with pytest.raises(distckpt.StorageError, match="symbolic link to .*which does not exist"):
        distckpt.export_weights(str(tmp_path / "root"), str(tmp_path / "out"))
    with pytest.raises(distckpt.MissingFileError, match="no committed checkpoint"):  # an empty root stays that
        distckpt.load_weights(str(tmp_path / "empty"), TinyLM())


def test_a_step_directory_replaced_by_a_link_is_said_damaged_by_load_weights_and_export(tmp_path, caplog):
    """The whole-root listing does not follow a step directory replaced by a symbolic link:
    load_weights and export took the step below without a word, while load_latest said the
    newest step was damaged. They try it now, as load_latest does, and say why they pass it."""
    import logging
    import shutil

    root = tmp_path / "ckpt"
    with distckpt.CheckpointManager(str(root), keep_last=None) as mgr:
        model = _trained()
        mgr.load_latest({"model": model})
        mgr.save(1, {"model": model})
        newer = _trained(seed=1)
        mgr.save(2, {"model": newer})
    shutil.move(str(root / "step-000000002"), str(tmp_path / "moved"))
    (root / "step-000000002").symlink_to(tmp_path / "moved")
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        report = distckpt.load_weights(str(root), TinyLM())
        distckpt.export_weights(str(root), str(tmp_path / "out"))
    assert report.step == 1
    said = [r.getMessage() for r in caplog.records if "step 2" in r.getMessage() and "symbolic link" in r.getMessage()]
    assert len(said) == 2, caplog.text


class _HeaderKeyNamed(nn.Module):
    """A module whose state_dict holds a tensor named like safetensors' reserved header key."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("__metadata__", nn.Parameter(torch.arange(2.0)))
        self.w = nn.Parameter(torch.ones(3))


def test_a_tensor_named_like_the_safetensors_metadata_is_refused_by_export_naming_it(tmp_path):
    """A Hugging Face file cannot hold a tensor named "__metadata__" (it replaced the file's
    metadata, and the export failed its own read-back naming no key): refused before anything is
    written; the checkpoint itself holds it and loads it as saved."""
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"model": _HeaderKeyNamed()})
    with pytest.raises(distckpt.IncompatibleCheckpointError, match=r"'__metadata__', the key the safetensors format reserves"):
        distckpt.export_weights(root, out)
    assert not os.path.exists(out), "nothing is written"
    fresh = _HeaderKeyNamed()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    distckpt.load_weights(root, fresh)
    assert torch.equal(fresh.get_parameter("__metadata__"), torch.arange(2.0)) and torch.equal(fresh.w, torch.ones(3))


def test_a_tensor_name_that_is_not_utf8_text_is_refused_by_export_naming_it():
    from distckpt.tools.hf_layout import check_tensor_names

    check_tensor_names(["a", "b.c", "é"], "src")
    with pytest.raises(distckpt.IncompatibleCheckpointError, match=r"src: the model's tensor name 'w\\ud800' is not UTF-8"):
        check_tensor_names(["a", "w\ud800"], "src")

"""Serialization: plain values and tensors only, no pickle, views as their own bytes."""

from __future__ import annotations

import ast
import json
import math
import os
import re

import pytest
import torch
from safetensors import safe_open
from torch import nn

import distckpt
from distckpt.io.safetensors_format import safetensors_chunks
from distckpt.io.serialize import encode_tree, load_tree_file


def roundtrip(value):
    data = b"".join(bytes(c) for c in safetensors_chunks(encode_tree(value)))
    return load_tree_file(data, "test"), data


def test_plain_values_keep_their_types():
    value = {"none": None, "t": True, "i": -3, "big": 2**80, "f": 0.1, "nan": float("nan"),
             "inf": float("inf"), "ninf": float("-inf"), "s": "é\n", "l": [1, (2, 3.0)],
             "tup": (), 7: {"nested": [[], {}]}, -1: "int keys"}
    back, _ = roundtrip(value)
    assert back.keys() == value.keys() and list(back) == list(value)
    assert math.isnan(back["nan"]) and back["inf"] == math.inf and back["ninf"] == -math.inf
    back["nan"] = value["nan"] = None
    assert back == value
    assert type(back["l"][1]) is tuple and type(back["i"]) is int and type(back["f"]) is float
    assert 7 in back and "7" not in back


@pytest.mark.parametrize("bad,path", [
    ({"config": {"schedule": lambda s: s}}, "state['config']['schedule'] is a function"),
    ({"obj": object()}, "state['obj'] is a builtins.object"),
    ({"d": {True: 1}}, "state['d'] has a key True"),
    ({"s": {1, 2}}, "state['s'] is a builtins.set"),
    ({"c": torch.zeros(2, dtype=torch.complex64)}, "state['c'] has dtype torch.complex64"),
])
def test_unstorable_values_are_refused_with_their_key_path(bad, path):
    with pytest.raises(distckpt.UnstorableValueError, match=path.replace("[", r"\[").replace("]", r"\]")):
        encode_tree(bad)


class _Meter:
    def state_dict(self) -> dict:
        return {"sum": 0.0}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_state_dict_owner_inside_a_container_is_refused_saying_where_owners_go(tmp_path):
    """The advice was "give its owner state_dict()/load_state_dict()" to an object that has both."""
    mgr = distckpt.CheckpointManager(str(tmp_path))
    for state in ({"meters": {"loss": _Meter()}}, {"meters": distckpt.per_rank({"loss": _Meter()})}):
        with pytest.raises(distckpt.UnstorableValueError, match=r"state\['meters'\]\['loss'\].*give each its own key"):
            mgr.save(0, state)
    mgr.save(0, {"loss": _Meter(), "mine": distckpt.per_rank(_Meter())})  # where owners go
    mgr.close()


def test_view_costs_its_own_bytes_not_its_storage():
    flat = torch.zeros(1_000_000)
    head = flat[:10]
    tree = encode_tree({"head": head})
    assert tree.payload_bytes == 40
    back, data = roundtrip({"head": head})
    assert len(data) < 1_000  # the seed's torch.save of the same view: 4,001,101 bytes
    assert torch.equal(back["head"], head)
    assert back["head"].untyped_storage().nbytes() == 40


def test_tied_tensors_are_stored_once_and_retied():
    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    sd = model.state_dict()
    tree = encode_tree(dict(sd))
    assert len(tree.tensors) == 1 and tree.payload_bytes == 50 * 8 * 4
    back, _ = roundtrip(dict(sd))
    assert back["0.weight"] is back["1.weight"]


def test_non_contiguous_and_odd_tensors_roundtrip():
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    values = {"t": base.t(), "strided": base[:, ::2], "scalar": torch.tensor(3.5),
              "empty": torch.zeros(0, 3), "bf16": torch.randn(5).to(torch.bfloat16),
              "bool": torch.tensor([True, False]), "i8": torch.tensor([-1, 2], dtype=torch.int8),
              "param": nn.Parameter(torch.ones(2))}
    back, _ = roundtrip(values)
    for k, v in values.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k], v.detach()), k
    assert back["t"].stride() == values["t"].stride()  # a transpose keeps its layout
    assert back["strided"].is_contiguous()               # a view with gaps comes back compact
    assert type(back["param"]) is nn.Parameter and back["param"].requires_grad


def test_the_file_opens_with_the_safetensors_library(tmp_path):
    values = {"a": torch.randn(3, 4), "b": [torch.arange(5)]}
    _, data = roundtrip(values)
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        assert names == {"a", "b/0"}
        assert torch.equal(f.get_tensor("a"), values["a"])
        assert f.metadata()["format"] == "distckpt-tree-v1"


def test_optimizer_and_scheduler_state_roundtrip_exactly():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}],
                            lr=1e-3, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    for sd in (opt.state_dict(), sched.state_dict()):
        back, _ = roundtrip(sd)
        assert _deep_equal(back, sd)
    opt2 = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}])
    opt2.load_state_dict(roundtrip(opt.state_dict())[0])
    assert _deep_equal(opt2.state_dict(), opt.state_dict())


def test_stateful_dataloader_state_roundtrips():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                                generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    for _ in range(3):
        next(it)
    sd = loader.state_dict()
    back, _ = roundtrip(sd)
    assert _deep_equal(back, sd)
    expected = [b.tolist() for b in it]
    resumed = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                                 generator=torch.Generator().manual_seed(0))
    resumed.load_state_dict(back)
    assert [b.tolist() for b in resumed] == expected


def test_loading_never_unpickles(tmp_path):
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    import pickle

    with pytest.raises(distckpt.CorruptCheckpointError):
        load_tree_file(pickle.dumps({"x": Evil()}), "hostile")
    torch.save({"x": torch.ones(1)}, tmp_path / "t.pt")
    with pytest.raises(distckpt.CorruptCheckpointError):
        load_tree_file((tmp_path / "t.pt").read_bytes(), "torch.save file")
    assert not canary.exists()


def _unpickling_sites(source: str) -> list[str]:
    """Calls and imports that unpickle, found in the code itself (a comment or a docstring that
    names torch.load is no offender)."""
    sites = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            sites += [f"import {n}" for n in names if n and n.split(".")[0] in ("pickle", "cPickle", "_pickle", "dill")]
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("torch.load", "pickle.load", "pickle.loads", "pickle.Unpickler", "torch.serialization.load"):
                sites.append(f"{func}(")
            sites += [f"{func}(weights_only=False)" for k in node.keywords
                      if k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is False]
    return sites


# The writer process (writer="process") and the trainer that started it exchange their requests
# as pickles over an anonymous socketpair the trainer made and the child inherited: the peer is this
# library's own code in the same process tree, never a file, a checkpoint or the network.
_IPC_WITH_OWN_CHILD = {"writer_process.py", "writer_child.py"}


def test_no_code_path_unpickles():
    """No module unpickles, except importing.py, which reads torch.save / DCP sources only behind
    trust_pickle=True and with torch's restricted weights_only=True unpickler (tests/unit/test_imports.py
    checks the refusal without the flag), and the writer process's pipe to its own trainer (above)."""
    pkg = os.path.dirname(distckpt.__file__)
    offenders = []
    for root, _, files in os.walk(pkg):
        for name in files:
            if name in _IPC_WITH_OWN_CHILD:
                text = open(os.path.join(root, name)).read()
                assert "storage.read" not in text and not re.search(r"(?<![\w.])open\(", text), \
                    f"{name} reads files or storage: its unpickling must stay on the socketpair"
                continue
            if name.endswith(".py") and name != "importing.py":  # checked on its own below
                offenders += [f"{name}: {site}" for site in _unpickling_sites(open(os.path.join(root, name)).read())]
    assert offenders == []
    importing = _unpickling_sites(open(os.path.join(pkg, "tools", "importing.py")).read())
    assert not any("weights_only=False" in s or "pickle" in s for s in importing), importing


def test_the_unpickling_scan_finds_what_it_looks_for():
    """The scan above is no check that can never fail: each form it refuses is found, a comment is not."""
    assert _unpickling_sites("import pickle") == ["import pickle"]
    assert _unpickling_sites("from _pickle import loads") == ["import _pickle"]
    assert _unpickling_sites("import torch\ntorch.load(f)") == ["torch.load("]
    assert _unpickling_sites("pickle.loads(b)") == ["pickle.loads("]
    assert _unpickling_sites("x.load(f, weights_only=False)") == ["x.load(weights_only=False)"]
    assert _unpickling_sites('# torch.load(f)\n"""pickle.load(f)"""') == []


def _deep_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("text", ['"' * 6000, "\\" * 6000, "\x01" * 3000])
def test_a_tree_whose_escaped_json_passes_the_header_limit_is_refused_at_save(tmp_path, monkeypatch, text):
    # The tree's JSON is a JSON string inside the header: quotes and backslashes double there. The
    # limit was counted on the unescaped JSON: committed, then refused by every load.
    from distckpt.io import safetensors_format
    monkeypatch.setattr(safetensors_format, "MAX_HEADER_BYTES", 40_000)
    value = {"notes": [text, text]}
    assert len(json.dumps(value)) < 40_000 < len(json.dumps(json.dumps(value)))
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match="bytes of header"):
            mgr.save(1, {"v": value})
        mgr.save(2, {"v": {"notes": [text[:1000]]}})  # under the limit escaped: loads back
    back: dict = {"v": {}}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest(back).step == 2
    assert back["v"] == {"notes": [text[:1000]]}


def _with_device_nodes(value, device):
    """value's file with every tensor node saying it was saved on `device` (what a GPU save writes)."""
    tree = encode_tree(value)

    def mark(node):
        if isinstance(node, dict):
            if "T" in node:
                node["dv"] = device
            for v in node.values():
                mark(v)
        elif isinstance(node, list):
            for v in node:
                mark(v)
    mark(tree.node)
    tree._node_json = None
    return b"".join(bytes(c) for c in safetensors_chunks(tree))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "xpu"])
def test_values_saved_on_an_absent_device_load_on_the_cpu_with_a_warning(device):
    value = {"ema": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, "tied": [torch.zeros(2)] * 2}
    data = _with_device_nodes(value, device)
    assert load_tree_file(data, "test")["ema"]["w"].device.type == "cpu"  # inspection: no placement, no warning
    with pytest.warns(distckpt.DeviceAbsentWarning, match=f"saved on {device} come back on the CPU") as caught:
        back = load_tree_file(data, "test", place=True)
    assert torch.equal(back["ema"]["w"], value["ema"]["w"]) and back["tied"][0] is back["tied"][1]
    # one warning for the tree, not one per tensor (a GPU EMA of thousands of tensors on a laptop)
    assert len([w for w in caught if w.category is distckpt.DeviceAbsentWarning]) == 1


@pytest.mark.parametrize("device", [3, "warp-drive:0", ["cuda"]])
def test_a_bad_device_in_a_tensor_node_is_corruption(device):
    data = _with_device_nodes({"t": torch.ones(2)}, device)
    with pytest.raises(distckpt.CorruptCheckpointError):
        load_tree_file(data, "test", place=True)


def test_cpu_tensors_record_no_device():
    tree = encode_tree({"t": torch.ones(2)}, placed=frozenset({()}))
    assert '"dv"' not in json.dumps(tree.node)


def _strided(shape, strides):
    t = torch.empty_strided(shape, strides)
    return t.copy_(torch.randn(shape))


@pytest.mark.parametrize("make", [
    lambda: nn.Conv2d(3, 2, 1).to(memory_format=torch.channels_last).weight.detach(),  # strides (3, 1, 3, 3)
    lambda: _strided((2, 1, 4, 4), (16, 1, 4, 1)),        # channels_last with one channel
    lambda: torch.randn(1, 3, 1).permute(2, 1, 0),         # a permute of size-1 dimensions
    lambda: _strided((2, 3, 1, 4, 1), (12, 1, 12, 3, 3)),  # channels_last_3d with size-1 dimensions
    lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    lambda: torch.randn(3, 4).t(),
], ids=["1x1-conv-channels-last", "one-channel", "permuted-size-1", "channels-last-3d", "channels-last", "transpose"])
def test_layouts_with_size_1_dimensions_come_back_with_their_strides(make):
    """torch calls these contiguous, yet empty_like, suggest_memory_format and the kernels read the
    layout from every stride: a 1x1 convolution's channels_last weight came back row-major."""
    t = make()
    back, _ = roundtrip({"t": t})
    assert back["t"].stride() == t.stride() and torch.equal(back["t"], t)
    assert back["t"].is_contiguous(memory_format=torch.channels_last) == t.is_contiguous(memory_format=torch.channels_last)


def test_bools_made_from_other_bytes_and_neg_views_come_back_as_torch_clones_them(tmp_path):
    """What the README says of values torch itself normalizes when it copies them: a bool viewed
    from the bytes 2 and 255 comes back with byte 1 (torch's clone() gives the same), a lazy
    negative view as its resolved values; in a value entry and into a live tensor alike."""
    import distckpt

    raw = torch.tensor([0, 1, 2, 255], dtype=torch.uint8)
    flags, negated = raw.view(torch.bool), torch.tensor([1.0, -2.0])._neg_view()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"value": {"flags": flags, "negated": negated}, "live": flags})
        state = {"value": None, "live": torch.zeros(4, dtype=torch.bool)}
        mgr.load(state, step=1)
    for loaded in (state["value"]["flags"], state["live"]):
        assert loaded.view(torch.uint8).tolist() == flags.clone().view(torch.uint8).tolist() == [0, 1, 1, 1]
    assert torch.equal(state["value"]["flags"], flags)
    assert not state["value"]["negated"].is_neg() and state["value"]["negated"].tolist() == [-1.0, 2.0]


def test_a_cycle_is_refused_as_a_cycle_naming_both_places(tmp_path):
    """It was refused 200 levels down as 'nests containers more than 200 deep'."""
    import distckpt

    looped = [1]
    looped.append(looped)
    back = {"a": {}}
    back["a"]["back"] = back["a"]
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match=re.escape("state['v'][1] is state['v'] itself (a cycle)")):
            mgr.save(1, {"v": looped})
        with pytest.raises(distckpt.UnstorableValueError,
                           match=re.escape("state['v']['a']['back'] is state['v']['a'] itself (a cycle)")):
            mgr.save(1, {"v": back})
        shared = [3]
        mgr.save(1, {"v": {"x": shared, "y": (shared, shared)}})  # shared, not a cycle: stored as equal copies
        state = {"v": None}
        mgr.load(state, step=1)
    assert state["v"] == {"x": [3], "y": ([3], [3])}


class _SetMeter:
    def __init__(self) -> None:
        self.seen = {3, 1}

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = set(state["seen"])


@pytest.mark.parametrize("value", [{3, 1}, frozenset({2})])
def test_a_set_from_an_owners_state_dict_is_refused_with_advice_for_the_set(tmp_path, value):
    """The advice for a set returned by a state_dict() was to give its owner state_dict() and
    load_state_dict(), which it had: it now says what to store instead."""
    meter = _SetMeter()
    meter.seen = value
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match=r"state\['meter'\]\['seen'\] is a builtins\.(frozen)?set.*sorted\(s\)") as err:
            mgr.save(0, {"meter": meter})
        assert "give its owner" not in str(err.value)


def _unstorable_dtypes() -> list:
    """Every dtype torch makes a plain tensor of that safetensors cannot hold (quantized dtypes,
    which torch.zeros cannot make, are refused as quantized tensors elsewhere)."""
    from distckpt.io.safetensors_format import DTYPE_TO_ST

    out = []
    for dtype in {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}:
        try:
            torch.zeros(2, dtype=dtype)
        except (RuntimeError, TypeError):
            continue
        if dtype not in DTYPE_TO_ST:
            out.append(dtype)
    return sorted(out, key=str)


@pytest.mark.parametrize("dtype", _unstorable_dtypes(), ids=str)
def test_an_unstorable_dtype_is_refused_with_advice_for_that_dtype(tmp_path, dtype):
    """float8_e4m3fnuz was refused with the complex numbers' advice (torch.view_as_real)."""
    with distckpt.CheckpointManager(str(tmp_path)) as mgr, pytest.raises(distckpt.UnstorableValueError) as caught:
        mgr.save(1, {"v": torch.zeros(2, dtype=dtype)})
    assert str(dtype) in str(caught.value)
    assert ("view_as_real" in str(caught.value)) == dtype.is_complex, caught.value

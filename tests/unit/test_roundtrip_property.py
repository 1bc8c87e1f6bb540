"""Every value `save` accepts comes back from `load` identical, or is refused at save time with
UnstorableValueError naming its key path. Trees are generated (hypothesis, seeded): plain values
of every type, tensors of every dtype, layout and memory format, shared tensors."""

from __future__ import annotations

import collections
import enum
import math
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import distckpt
from distckpt.io.safetensors_format import safetensors_chunks
from distckpt.io.serialize import encode_tree, load_tree_file

EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40"))
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool] + [
          getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    n = math.prod(shape)
    if n == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))  # any bits: NaNs of every kind
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
        t = t.bitwise_and(1).to(torch.bool).reshape(shape) if dtype == torch.bool else t.view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "channels_last", "sliced", "last_of_row"]))
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "channels_last" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    elif layout == "last_of_row" and t.numel() > 1:  # logits[:, -1] of a batch of one: shape (1,), stride (n,)
        t = t.reshape(1, -1)[:, -1]
    kind = draw(st.sampled_from(["tensor", "parameter", "requires_grad"]))
    if t.is_floating_point() and kind == "parameter":
        t = nn.Parameter(t, requires_grad=draw(st.booleans()))
    elif t.is_floating_point() and kind == "requires_grad":
        t = t.detach().requires_grad_(True)
    # Layouts torch's own memory formats and transposes make keep every stride, size-1 dims' too
    # (a 1x1 convolution's channels_last weight); a slice's or logits[:, -1]'s odd size-1 stride
    # comes back canonical (README). An attribute of the saved object: compared in assert_identical.
    t._every_stride_kept = layout in ("contiguous", "transposed", "channels_last")  # type: ignore[attr-defined]
    return t


def floats_with_bits():
    specials = st.sampled_from([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                                struct.unpack("<d", bytes.fromhex("01000000f0ff7f7f"))[0]])
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True), specials)


numpy_scalars = st.one_of(st.integers(-2**63, 2**63 - 1).map(np.int64), st.floats(width=32).map(np.float32),
                          st.floats().map(np.float64), st.booleans().map(np.bool_),
                          st.integers(0, 255).map(np.uint8),
                          # types whose dtype.str is another's (np.longlong is '<i8' like np.int64)
                          st.integers(-2**63, 2**63 - 1).map(np.longlong), st.integers(0, 2**64 - 1).map(np.ulonglong),
                          st.integers(-2**31, 2**31 - 1).map(np.intc), st.floats(width=16).map(np.float16))
# ints beyond 64 bits, up to past the 4,300 digits Python's int/str conversion refuses
big_ints = st.tuples(st.sampled_from([1, -1]), st.integers(64, 20_000), st.integers(0, 2**64)).map(
    lambda t: t[0] * (2 ** t[1] + t[2]))
def _counter(items: dict) -> collections.Counter:
    """A Counter holding exactly these items (Counter(pairs) would count the pairs)."""
    out: collections.Counter = collections.Counter()
    for k, v in items.items():
        out[k] = v
    return out


leaves = st.one_of(st.none(), st.booleans(), st.integers(), big_ints,
                   floats_with_bits(), st.text(max_size=8), numpy_scalars, tensors(),
                   st.lists(st.integers(0, 5), max_size=3).map(torch.Size))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
trees = st.recursive(leaves, lambda children: st.one_of(
    st.lists(children, max_size=4), st.lists(children, max_size=4).map(tuple),
    st.dictionaries(keys, children, max_size=4),
    st.dictionaries(keys, children, max_size=4).map(collections.OrderedDict),
    st.dictionaries(keys, children, max_size=4).map(_counter)), max_leaves=12)


def _bits(t):
    """The elements' bits, compared as bytes (NaN payloads included); a fresh compact copy first:
    view(torch.uint8) refuses a size-1 dimension's odd stride."""
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def assert_identical(a, b, path="value", seen=None):
    assert type(a) is type(b), f"{path}: {type(a).__name__} saved, {type(b).__name__} loaded"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        if a.numel() and getattr(a, "_every_stride_kept", False):
            assert a.stride() == b.stride(), f"{path}: strides {a.stride()} saved, {b.stride()} loaded"
        if a.numel() and (a.is_contiguous() or a.is_contiguous(memory_format=torch.channels_last) or _dense(a)):
            strides = [(x, y) for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1]  # a size-1 dim's is moot
            assert all(x == y for x, y in strides), f"{path}: strides {a.stride()} saved, {b.stride()} loaded"
        assert torch.equal(_bits(a), _bits(b)), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} saved, {b!r} loaded"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _dense(t):
    return t.dim() >= 2 and sorted(t.stride(), reverse=True) == list(torch.empty(
        [t.shape[d] for d in sorted(range(t.dim()), key=lambda d: -t.stride(d))]).stride())


def _tensors_in(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, out)
    return out


def _through_the_manager(tmp_path, value, **options):
    with distckpt.CheckpointManager(str(tmp_path), **options) as mgr:
        step = (max(mgr.committed_steps()) + 1) if mgr.committed_steps() else 0
        mgr.save(step, {"v": distckpt.per_rank({"x": value}), "r": {"x": value}})
    state = {"v": distckpt.per_rank({}), "r": {}}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load(state, step)
    return state["v"].obj["x"], state["r"]["x"]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(value=trees, options=st.sampled_from([{}, {"async_save": True}, {"incremental": True}]))
def test_every_stored_tree_comes_back_identical(tmp_path_factory, value, options):
    tensors = [t for t in _tensors_in(value, []) if t.numel()]
    resizable = [t.untyped_storage().resizable() for t in tensors]
    back_rank, back_replicated = _through_the_manager(tmp_path_factory.mktemp("rt"), value, **options)
    assert_identical(value, back_rank)
    assert_identical(value, back_replicated)
    # a save reads the live tensors, never changes them (.numpy() left storages non-resizable)
    assert [t.untyped_storage().resizable() for t in tensors] == resizable


@settings(max_examples=max(10, EXAMPLES // 2), deadline=None, derandomize=True)
@given(value=trees, options=st.sampled_from([{}, {"incremental": True}]))
def test_every_stored_tree_can_be_inspected(tmp_path_factory, value, options):
    """`distckpt inspect` reads what any save wrote (it failed on transposed, expanded,
    channels_last tensors and Parameters: its placeholders could not be re-strided)."""
    from distckpt.storage import open_storage
    from distckpt.tools.inspection import describe_step

    root = tmp_path_factory.mktemp("inspect")
    with distckpt.CheckpointManager(str(root), **options) as mgr:
        mgr.save(0, {"v": distckpt.per_rank({"x": value}), "r": {"x": value}})
        mgr.save(1, {"v": distckpt.per_rank({"x": value}), "r": {"x": value}})
    for step in (0, 1):
        described = describe_step(open_storage(str(root)), step)
        listed = {(t["dtype"], tuple(t["shape"])) for t in described["tensors"]}
        for t in _tensors_in(value, []):
            assert (str(t.dtype).replace("torch.", ""), tuple(t.shape)) in listed
        assert described["bytes_owned"] + described["bytes_shared"] >= sum(t["bytes"] for t in described["tensors"])


@settings(max_examples=max(10, EXAMPLES // 3), deadline=None, derandomize=True)
@given(value=trees)
def test_a_tensor_in_two_places_comes_back_as_one(tmp_path_factory, value):
    shared, empty = torch.arange(6.0), torch.zeros(2, 0)  # an empty one too: no address to name it by
    tree = {"a": shared, "b": [value, shared], "e": empty, "f": [empty, torch.zeros(2, 0)]}
    _, back = _through_the_manager(tmp_path_factory.mktemp("tie"), tree)
    assert back["a"] is back["b"][1]
    assert back["e"] is back["f"][0] and back["f"][1] is not back["e"]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(value=trees, live=st.sampled_from(["none", "dict", "ordered", "list", "tuple", "int", "float", "tensor"]),
       async_save=st.booleans())
def test_a_tree_held_directly_as_an_entry_comes_back_identical_whatever_the_live_placeholder(
        tmp_path_factory, value, live, async_save):
    """The tree is the entry itself (not inside a dict): a live container of the saved type is
    refilled in place (its holders see the values); any other placeholder is replaced, a tensor
    placeholder of a plain value too and a plain placeholder of a tensor (a best loss kept as a
    float until an evaluation makes it a 0-d tensor)."""
    placeholder = {"none": None, "dict": {"stale": 1}, "ordered": collections.OrderedDict(stale=1),
                   "list": [1, 2], "tuple": (1,), "int": 7, "float": 1e9, "tensor": torch.tensor(1e9)}[live]
    assume(not (isinstance(value, torch.Tensor) and isinstance(placeholder, torch.Tensor)))  # copied into in place
    root = str(tmp_path_factory.mktemp("top"))
    with distckpt.CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(1, {"v": value, "r": distckpt.per_rank(value)})
    state = {"v": placeholder, "r": distckpt.per_rank(placeholder)}
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load(state, 1)
    assert_identical(value, state["v"], "state['v']")
    assert_identical(value, state["r"].obj, "state['r']")
    if type(placeholder) is type(value) and isinstance(value, (dict, list)):
        assert state["v"] is placeholder, "a live container of the saved type is refilled in place"


def _replicated_digest(value):
    from distckpt.protocol.agreement import replicated_digests
    from distckpt.state.capture import Entry

    return replicated_digests([Entry("v", "replicated", "value", value)])["v"]


def _sorted_dicts(value):
    """The value with every plain dict's items in key order (the ranks' digests ignore a plain
    dict's order, not an OrderedDict's)."""
    if type(value) is collections.OrderedDict:
        return collections.OrderedDict((k, _sorted_dicts(v)) for k, v in value.items())
    if type(value) is collections.Counter:  # ordered too, as an OrderedDict
        return _counter({k: _sorted_dicts(v) for k, v in value.items()})
    if isinstance(value, dict):
        items = sorted(((k, _sorted_dicts(v)) for k, v in value.items()), key=lambda kv: (type(kv[0]).__name__, kv[0]))
        return type(value)(items)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_sorted_dicts(v) for v in value)
    return value


@settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True)
@given(a=trees, b=trees)
def test_the_ranks_digest_of_a_replicated_value_is_equal_exactly_when_the_values_are_identical(a, b):
    """What save() compares across ranks: a copy digests alike; two trees that digest alike are
    identical (type, bits, structure), up to the order of a dict's items."""
    import copy

    assert _replicated_digest(a) == _replicated_digest(copy.deepcopy(a))
    if _replicated_digest(a) == _replicated_digest(b):
        assert_identical(_sorted_dicts(a), _sorted_dicts(b))
    if a is not b and isinstance(a, torch.Tensor) and a.numel():
        flipped = a.detach().contiguous().clone()
        flipped.view(-1).view(torch.uint8)[0] ^= 1
        assert _replicated_digest(a) != _replicated_digest(flipped)


class Colour(enum.IntEnum):
    RED = 1


class Mode(str, enum.Enum):
    TRAIN = "train"


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("bad, what", [
    (Colour.RED, "subclass of int"), (Mode.TRAIN, "subclass of str"), (Point(1, 2), "namedtuple"),
    (collections.defaultdict(list), "defaultdict"),
    (np.arange(3), "NumPy arrays"), (np.str_("x"), "NumPy <U1"), (lambda: 0, "function"),
    (torch.eye(3).to_sparse(), "layout torch.sparse_coo"), (torch.eye(3).to_sparse_csr(), "sparse_csr"),
    (torch.eye(3).to_sparse_csc(), "sparse_csc"), (torch.eye(4).to_sparse_bsr((2, 2)), "sparse_bsr"),
    (torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "nested"),
    (torch.empty(3, device="meta"), "meta tensor"), (torch.zeros(2, dtype=torch.complex64), "complex"),
    (nn.parameter.UninitializedParameter(), "subclass"),
])
def test_what_cannot_come_back_identical_is_refused_at_save_naming_the_key(tmp_path, bad, what):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match=r"state\['cfg'\]\['deep'\]\[1\]") as info:
            mgr.save(1, {"cfg": {"deep": [0, bad]}})
        assert what.lower() in str(info.value).lower()
        assert mgr.committed_steps() == []


class Tag(str):
    pass


@pytest.mark.parametrize("key, what", [
    (Colour.RED, "subclass of int"), (Mode.TRAIN, "subclass of str"), (Tag("t"), "subclass of str"),
    (np.str_("n"), "subclass of str"), (np.int64(3), "subclass of int"), (np.uint8(3), "subclass of int"),
    (True, "type bool"), (1.5, "type float"), ((1, 2), "type tuple"), (None, "type NoneType"),
])
def test_a_key_that_cannot_come_back_identical_is_refused_at_save_naming_the_dict(tmp_path, key, what):
    """Keys as values: a key of a subclass of str or int would come back as the plain type."""
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match=r"state\['cfg'\]\['deep'\]\[1\] has a key") as info:
            mgr.save(1, {"cfg": {"deep": [0, {"fine": 1, key: 2}]}})
        assert what.lower() in str(info.value).lower()
        assert mgr.committed_steps() == []


@pytest.mark.parametrize("key", ["cfg", "config"])
@pytest.mark.parametrize("bad, what", [(collections.defaultdict(list, a=[1]), "defaultdict"),
                                       (Point(1, 2), "namedtuple")])
def test_a_dict_subclass_held_directly_as_an_entry_is_refused_at_save(tmp_path, key, bad, what):
    """At the top of an entry too (it was copied into a plain dict there, and came back as one)."""
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match=rf"^state\['{key}'\] is") as info:
            mgr.save(1, {key: bad})
        assert what.lower() in str(info.value).lower()
        assert mgr.committed_steps() == []


def test_a_deep_tree_is_refused_at_save_not_at_load(tmp_path):
    deep: list = []
    for _ in range(500):
        deep = [deep]
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match="deep"):
            mgr.save(1, {"v": deep})


@pytest.mark.parametrize("per_rank", [False, True])
def test_the_nesting_limit_is_200_deep_counted_from_the_entry_and_named_by_its_key_path(tmp_path, per_rank):
    def nest(depth: int) -> list:
        value: list = []
        for _ in range(depth - 1):
            value = [value]
        return value

    wrap = distckpt.per_rank if per_rank else (lambda v: v)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"v": wrap(nest(200))})  # the documented limit: more than 200 is refused
        with pytest.raises(distckpt.UnstorableValueError, match=r"^state\['v'\]\[0\]\[0\].* more than 200 deep"):
            mgr.save(2, {"v": wrap(nest(201))})
    state = {"v": wrap([])}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest(state).step == 1
    assert (state["v"].obj if per_rank else state["v"]) == nest(200)


@pytest.mark.faults  # make test-faults (4M floats)
def test_a_long_plain_list_is_stored_and_loaded(tmp_path):
    # 4M floats in a plain list used to commit and then be refused by every load.
    values = [float(i) / 3 for i in range(4_000_000)]
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"v": values})
    state = {"v": []}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(state)
    assert state["v"] == values


def test_the_tree_limits_are_the_same_for_save_and_load():
    from distckpt.io import safetensors_format
    data = b"".join(bytes(c) for c in safetensors_chunks(encode_tree({"x": [torch.zeros(1)] * 3})))
    assert load_tree_file(bytearray(data), "t")["x"][0].shape == (1,)
    assert safetensors_format.MAX_TENSORS >= 4_000_000  # a million parameters with their AdamW state


def test_a_tensor_held_by_two_entries_comes_back_as_one_object(tmp_path):
    """Ties across entries: a tensor entry also held in a list, a model's parameters also held in a
    dict beside it (an EMA or a parameter group kept next to the model) stay the live objects, so
    an in-place update of one still reaches the other after the resume."""
    import distckpt

    def make(seed):
        torch.manual_seed(seed)
        t, model = torch.randn(3), torch.nn.Linear(2, 2)
        return {"a": t, "b": [t], "model": model, "extra": {"w": model.weight, "n": 1}}

    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, make(1))
    live = make(0)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(live)
    saved = make(1)
    assert live["b"][0] is live["a"] and torch.equal(live["a"], saved["a"])
    assert live["extra"]["w"] is live["model"].weight and torch.equal(live["model"].weight, saved["model"].weight)
    with torch.no_grad():
        live["model"].weight.add_(1)
    assert torch.equal(live["extra"]["w"], live["model"].weight)


@pytest.mark.parametrize("key", ["weights", "config", "state_dict"])
def test_a_plain_tensor_is_classified_as_every_kind_in_turn_would(key):
    """classify takes a short cut for plain tensors and Parameters: it gives what asking each
    registered kind in turn gives, under any key (a tensor named "config" is a config entry)."""
    from distckpt.state import kinds
    for obj in (torch.zeros(3), torch.nn.Parameter(torch.zeros(2)), torch.zeros(2).to_sparse(),
                torch.zeros((), dtype=torch.int64)):
        by_kinds = next(k for k in kinds.registered_kinds() if k.matches(key, obj))
        (entry,) = kinds.classify({key: obj})
        assert entry.kind == by_kinds.name, (key, obj)


def test_a_counter_comes_back_a_counter_and_multisteplr_resumes(tmp_path):
    """MultiStepLR keeps its milestones in a collections.Counter: refused before, so no loop with
    that scheduler could save. A Counter comes back as one, its order and values kept."""
    counter = collections.Counter({30: 1, 10: 2, "x": -1})
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5, 5], gamma=0.5)
    for _ in range(4):
        opt.step()
        sched.step()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(4, {"c": counter, "nested": {"c": counter}, "opt": opt, "sched": sched})
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[7], gamma=0.1)
    back = {"c": None, "nested": None, "opt": opt2, "sched": sched2}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest(back).step == 4
    for c in (back["c"], back["nested"]["c"]):
        assert type(c) is collections.Counter and list(c.items()) == list(counter.items())
    assert sched2.milestones == sched.milestones and type(sched2.milestones) is collections.Counter
    for _ in range(3):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize("options", [{}, {"async_save": True}, {"incremental": True}], ids=["sync", "async", "incremental"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_single_element_with_an_odd_stride_saves_in_every_mode(tmp_path, dtype, options):
    """logits[:, -1] of a batch of one: shape (1,), stride (5,), which torch calls contiguous. Its
    byte view failed inside the write (a bare RuntimeError) for 2-8 byte dtypes."""
    rows = torch.arange(10).reshape(2, 5).to(dtype)
    value = {"last": rows[:1, -1], "column": rows[:1, 2:3].t(), "empty": rows[:0, -1]}
    back_rank, back_replicated = _through_the_manager(tmp_path, value, **options)
    assert_identical(value, back_rank)
    assert_identical(value, back_replicated)


@settings(max_examples=max(10, EXAMPLES // 2), deadline=None, derandomize=True)
@given(a=trees, b=trees, same=st.booleans())
def test_diff_reports_a_change_exactly_when_a_load_would_differ(tmp_path_factory, a, b, same):
    """`distckpt diff` compares what a load restores: types (1 against 1.0), float bits (-0.0),
    an OrderedDict's order, Parameters and requires_grad, a tensor against a number."""
    from distckpt.storage import open_storage
    from distckpt.tools.inspection import diff_steps

    if same:
        b = a
    try:
        assert_identical(a, b)
        identical = True
    except AssertionError:
        identical = False
    root = tmp_path_factory.mktemp("diff")
    with distckpt.CheckpointManager(str(root)) as mgr:
        mgr.save(0, {"v": {"x": a}})
        mgr.save(1, {"v": {"x": b}})
    rows = [r for r in diff_steps(open_storage(str(root)), 0, 1) if "/entries/v/" in r["key"]]
    assert (rows == []) == identical, (rows, identical)


@pytest.mark.parametrize("a, b", [({1: 2.0}, {"1": 2.0}), ([1, 2], (1, 2)), ({"k": 0.0}, {"k": -0.0}),
                                  ([1.0], [1]), (collections.OrderedDict(a=1, b=2), collections.OrderedDict(b=2, a=1)),
                                  ({"t": torch.ones(1)}, {"t": 1.0}), ({}, [])])
def test_diff_sees_each_change_a_load_would_show(tmp_path, a, b):
    from distckpt.storage import open_storage
    from distckpt.tools.inspection import diff_steps

    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(0, {"v": {"x": a}})
        mgr.save(1, {"v": {"x": b}})
    assert [r for r in diff_steps(open_storage(str(tmp_path)), 0, 1) if "/entries/v/" in r["key"]]



@settings(max_examples=max(10, EXAMPLES // 2), deadline=None, derandomize=True)
@given(value=trees, other=trees, same=st.booleans())
def test_config_diff_lists_a_key_exactly_when_its_value_would_not_come_back_identical(tmp_path_factory, value,
                                                                                     other, same):
    """config_diff judges values as a load gives them back (type and bits: NaNs, -0.0, 1 against
    True or 1.0, NumPy scalars, tensors, tuples against lists): a key is listed if and only if the
    run's value differs from the checkpoint's by the round trip's own identity check."""
    import copy

    now = copy.deepcopy(value) if same else other
    try:
        assert_identical(value, now)
        identical = True
    except AssertionError:
        identical = False
    root = str(tmp_path_factory.mktemp("cfg"))
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"config": {"v": value}})
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load_latest({"config": {"v": now}})
    assert (progress.config_diff == ()) == identical, (value, now, progress.config_diff)


@settings(max_examples=max(10, EXAMPLES // 3), deadline=None, derandomize=True)
@given(t=tensors(), async_save=st.booleans())
def test_a_parameter_and_its_detach_in_one_value_come_back_on_one_memory(tmp_path_factory, t, async_save):
    """An EMA helper keeping `p` and `p.detach()`: stored once, back as two objects on one memory
    (an update through one shows in the other), each with its own flags."""
    if not t.is_floating_point() or t.numel() == 0:
        t = torch.arange(6.0).reshape(2, 3)
    p = t if isinstance(t, nn.Parameter) else nn.Parameter(t.detach())
    value = {"p": p, "d": p.detach()}
    back, _ = _through_the_manager(tmp_path_factory.mktemp("pd"), value, async_save=async_save)
    assert type(back["p"]) is nn.Parameter and type(back["d"]) is torch.Tensor
    assert back["p"].data_ptr() == back["d"].data_ptr() and back["p"].stride() == back["d"].stride()
    assert torch.equal(_bits(back["p"]), _bits(p)) and back["p"].requires_grad == p.requires_grad
    assert not back["d"].requires_grad


@settings(max_examples=max(20, EXAMPLES), deadline=None, derandomize=True)
@given(data=st.data())
def test_every_dense_dimension_order_comes_back_with_every_stride(tmp_path_factory, data):
    """A tensor laid out in any dimension order by torch itself (a permute of a compact tensor,
    channels_last), size-1 dimensions included: every stride comes back (empty_like and
    suggest_memory_format read the size-1 ones too; a 1x1 convolution's channels_last weight
    came back row-major)."""
    shape = data.draw(st.lists(st.integers(1, 3), min_size=2, max_size=4), label="shape")
    if len(shape) == 4 and data.draw(st.booleans(), label="channels_last"):
        t = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    else:
        order = data.draw(st.permutations(range(len(shape))), label="order")
        inverse = [order.index(d) for d in range(len(shape))]
        t = torch.randn([shape[d] for d in order]).permute(*inverse)
    back, _ = _through_the_manager(tmp_path_factory.mktemp("order"), t)
    assert back.stride() == t.stride(), (shape, t.stride(), back.stride())
    assert torch.equal(back, t)


# -- keys of any text: each round-trips exactly, or is refused at save naming it ----------------
#
# Keys name the tensors in a file's header (key paths joined by "/"), so they reach JSON, the
# header's reserved "__metadata__" key, and the safetensors library's strict UTF-8. A key with a
# lone surrogate was written into a file that library could not open; `{"__metadata__": t}`
# encoded at the top of a file replaced the file's metadata.

HOSTILE_KEY_TEXT = ["__metadata__", "", "::", "a::b", "[", "]", "[0]", "?", "#", "#1", "/", "a/b", "//", "%",
                    "%2F", ".", "..", "a.b", "tensor", "format", "distckpt.tree", "é", "\U0001f600", "\ud800",
                    "w\udfff", "\udc80x"]
hostile_keys = st.one_of(
    st.sampled_from(HOSTILE_KEY_TEXT),
    st.text(alphabet=st.sampled_from([":", "[", "]", "?", "#", "/", "%", ".", "a", "é", "\ud800", "\udc00"]),
            max_size=6),
    st.integers(300, 5000).map(lambda n: "k/." * n),  # very long, past any path or name limit
)
small_leaves = st.one_of(st.none(), st.integers(), st.text(max_size=4),
                         st.integers(0, 3).map(lambda n: torch.arange(float(n))))
hostile_trees = st.recursive(small_leaves, lambda children: st.dictionaries(hostile_keys, children, max_size=3),
                             max_leaves=8)


def _keys_without_utf8(value, path=()):
    """The key paths of every str key that has no UTF-8 form (a lone surrogate)."""
    out = []
    if isinstance(value, dict):
        for key, child in value.items():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                out.append(path + (key,))
            out += _keys_without_utf8(child, path + (key,))
    return out


def _refused_naming_a_key(error: BaseException, paths: list) -> None:
    from distckpt.io.serialize import key_path

    message = str(error)
    message.encode("utf-8")  # prints: the key is escaped
    assert any(key_path(p) in message for p in paths), (message, paths)


def _every_file_opens_with_safetensors(root: str) -> None:
    """Any safetensors reader opens what was written: the library itself, every header and tensor."""
    from safetensors import safe_open

    files = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".safetensors")]
    assert files
    for path in files:
        with safe_open(path, framework="pt") as f:
            assert f.metadata()["format"] == "distckpt-tree-v1"
            for name in f.keys():
                f.get_tensor(name)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(state=st.dictionaries(hostile_keys, hostile_trees, min_size=1, max_size=3), per_rank=st.booleans())
def test_keys_of_any_text_come_back_exactly_or_are_refused_at_save_naming_the_key(tmp_path_factory, state, per_rank):
    root = str(tmp_path_factory.mktemp("keys"))
    wrap = distckpt.per_rank if per_rank else (lambda v: v)
    unwritable = _keys_without_utf8(state)
    with distckpt.CheckpointManager(root) as mgr:
        if unwritable:
            with pytest.raises(distckpt.UnstorableValueError) as info:
                mgr.save(1, {key: wrap(value) for key, value in state.items()})
            _refused_naming_a_key(info.value, unwritable)
            assert not [n for n in os.listdir(root) if n.startswith("step-")], "nothing of the step is written"
            return
        mgr.save(1, {key: wrap(value) for key, value in state.items()})
    _every_file_opens_with_safetensors(root)
    back = {key: wrap(None) for key in state}
    with distckpt.CheckpointManager(root) as mgr:
        assert mgr.load_latest(back).step == 1
    for key, value in state.items():
        assert_identical(value, back[key].obj if per_rank else back[key], f"state[{key!r}]")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(tree=st.dictionaries(hostile_keys, hostile_trees, max_size=4))
def test_a_tree_file_of_any_keys_opens_with_safetensors_and_decodes_identically(tmp_path_factory, tree):
    """Encoded at the top of a file (as the shard files are): a key that is the header's reserved
    name at the top level names a tensor there too."""
    unwritable = _keys_without_utf8(tree)
    if unwritable:
        with pytest.raises(distckpt.UnstorableValueError) as info:
            encode_tree(tree)
        _refused_naming_a_key(info.value, unwritable)
        return
    data = b"".join(bytes(c) for c in safetensors_chunks(encode_tree(tree)))
    folder = tmp_path_factory.mktemp("file")
    (folder / "tree.safetensors").write_bytes(data)
    _every_file_opens_with_safetensors(str(folder))
    assert_identical(tree, load_tree_file(bytearray(data), "tree"))


@pytest.mark.parametrize("where", ["entry", "per-rank entry", "in a dict", "over a tensor", "in a list", "deep",
                                   "in an OrderedDict"])
def test_a_key_that_is_not_utf8_text_is_refused_at_save_naming_it_and_nothing_is_written(tmp_path, where):
    bad = "w\ud800"
    state = {"entry": {bad: torch.ones(2)}, "per-rank entry": {bad: distckpt.per_rank({"x": 1})},
             "in a dict": {"cfg": {bad: 1}}, "over a tensor": {"cfg": {bad: torch.ones(2)}},
             "in a list": {"cfg": [0, {bad: 1}]}, "deep": {"cfg": {"a": {"b": {bad: {"c": 1}}}}},
             "in an OrderedDict": {"cfg": collections.OrderedDict([("ok", 1), (bad, torch.zeros(1))])}}[where]
    expected = {"entry": r"state\['w\\ud800'\]", "per-rank entry": r"state\['w\\ud800'\]",
                "in a dict": r"state\['cfg'\]\['w\\ud800'\]", "over a tensor": r"state\['cfg'\]\['w\\ud800'\]",
                "in a list": r"state\['cfg'\]\[1\]\['w\\ud800'\]",
                "deep": r"state\['cfg'\]\['a'\]\['b'\]\['w\\ud800'\]",
                "in an OrderedDict": r"state\['cfg'\]\['w\\ud800'\]"}[where]
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match=expected + r": the key is not UTF-8 text") as info:
            mgr.save(1, state)
        str(info.value).encode("utf-8")
        assert mgr.committed_steps() == []
    assert not [n for n in os.listdir(tmp_path) if n.startswith("step-")]


@pytest.mark.parametrize("per_rank", [False, True])
def test_a_key_named_like_the_headers_metadata_comes_back_at_any_depth(tmp_path, per_rank):
    wrap = distckpt.per_rank if per_rank else (lambda v: v)
    value = {"__metadata__": torch.arange(3.0), "cfg": {"__metadata__": {"__metadata__": torch.ones(2)}}}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"__metadata__": wrap(value), "t": torch.zeros(1)})
    _every_file_opens_with_safetensors(str(tmp_path))
    back = {"__metadata__": wrap(None), "t": torch.ones(1)}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(back)
    assert_identical(value, back["__metadata__"].obj if per_rank else back["__metadata__"])
    # at the top of a file, where the key alone names the tensor
    data = b"".join(bytes(c) for c in safetensors_chunks(encode_tree({"__metadata__": torch.arange(2.0)})))
    (tmp_path / "top.safetensors").write_bytes(data)
    _every_file_opens_with_safetensors(str(tmp_path))
    assert torch.equal(load_tree_file(bytearray(data), "top")["__metadata__"], torch.arange(2.0))


_LEAF_VALUES = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4),
    st.integers(-(2**64), 2**64),  # across int64's edges: beyond them an int is tagged
    st.floats(allow_nan=True, allow_infinity=True),  # non-finite floats are tagged
)


@settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True)
@given(items=st.one_of(st.lists(_LEAF_VALUES, max_size=40),
                       st.lists(st.integers(-(2**63) - 2, 2**63 + 1), max_size=700),
                       st.lists(st.floats(), max_size=40)),
       as_tuple=st.booleans())
def test_a_sequence_of_plain_values_encodes_as_its_items_do_one_by_one(items, as_tuple):
    """A list or tuple whose items all encode as themselves is taken whole (one pass over it, not an
    encode per item): its node must be exactly what encoding each item alone gives, and come back equal."""
    value = tuple(items) if as_tuple else list(items)
    node = encode_tree({"v": value}).node
    one_by_one = [encode_tree({"v": item}).node["d"][0][1] for item in items]
    assert node["d"][0][1] == {"t" if as_tuple else "l": one_by_one}
    back = load_tree_file(b"".join(bytes(c) for c in safetensors_chunks(encode_tree({"v": value}))), "test")["v"]
    assert type(back) is type(value) and len(back) == len(value)
    for got, want in zip(back, value):
        assert type(got) is type(want)
        assert got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got))

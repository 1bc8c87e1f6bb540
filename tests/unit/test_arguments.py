"""Every argument is checked: a bad one raises ConfigError naming it and saying what to pass,
never a raw TypeError/ValueError/OverflowError from inside, and never accepted silently."""

from __future__ import annotations

import datetime
import math
import os
import pathlib
import signal

import numpy as np
import pytest
import torch

import distckpt
from distckpt.config import SETTINGS, ManagerConfig
from distckpt.storage import NonAtomicStorageWarning


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_setting_refuses_a_bad_value_naming_itself(tmp_path, name):
    with pytest.raises(distckpt.ConfigError, match=name):
        distckpt.CheckpointManager(str(tmp_path), **{name: SETTINGS[name]})


def test_the_settings_table_covers_every_field():
    import dataclasses

    assert {f.name for f in dataclasses.fields(ManagerConfig)} == set(SETTINGS)


# The two-tier settings (tiers.TierSettings), each refused by name; the last two with a local_dir.
TIER_SETTINGS = {"local_dir": {"local_dir": 3}, "durable_every": {"local_dir": "L", "durable_every": 0},
                 "keep_local": {"local_dir": "L", "keep_local": -1}}


@pytest.mark.parametrize("name", sorted(TIER_SETTINGS))
def test_every_tier_setting_refuses_a_bad_value_naming_itself(tmp_path, name):
    kwargs = {k: (str(tmp_path / v) if v == "L" else v) for k, v in TIER_SETTINGS[name].items()}
    with pytest.raises(distckpt.ConfigError, match=name):
        distckpt.CheckpointManager(str(tmp_path / "root"), **kwargs)


# The memory tier's settings (memory_tier.MemorySettings), each refused by name.
MEMORY_SETTINGS = {"memory_tier": {"memory_tier": "yes"}, "memory_every": {"memory_tier": True, "memory_every": 0},
                   "keep_memory": {"memory_tier": True, "keep_memory": -1},
                   "disk_every": {"memory_tier": True, "disk_every": "10"}}


@pytest.mark.parametrize("name", sorted(MEMORY_SETTINGS))
def test_every_memory_setting_refuses_a_bad_value_naming_itself(tmp_path, name):
    with pytest.raises(distckpt.ConfigError, match=name):
        distckpt.CheckpointManager(str(tmp_path / "root"), **MEMORY_SETTINGS[name])


def test_every_constructor_parameter_is_checked_by_one_of_the_tables():
    import inspect

    params = set(inspect.signature(distckpt.CheckpointManager.__init__).parameters) - {"self", "url"}
    assert params == set(SETTINGS) | set(TIER_SETTINGS) | set(MEMORY_SETTINGS) | {"storage_options"}


@pytest.mark.parametrize("kwargs", [
    {"timeout": None}, {"timeout": math.inf}, {"timeout": -1}, {"timeout": "60"}, {"timeout": 10**400},
    {"timeout": 1e-9}, {"timeout": datetime.timedelta(microseconds=1)},
    {"timeout": datetime.timedelta(days=400)}, {"leftover_grace_s": math.inf}, {"leftover_grace_s": True},
    {"preemption_signals": ["SIGTERM", "SIGKILL"]}, {"preemption_signals": "NOPE"}, {"preemption_signals": 12345},
    {"preemption_signals": 3.5}, {"storage_options": "key=x"}, {"storage_options": {"key": "x"}},
    {"keep_last": True}, {"keep_best": 1.5}, {"best_mode": None}, {"world_size_policy": ["refuse"]},
])
def test_bad_constructor_arguments_are_config_errors(tmp_path, kwargs):
    if kwargs == {"timeout": None}:
        assert distckpt.CheckpointManager(str(tmp_path), **kwargs).config.timeout == 600.0  # the default
        return
    with pytest.raises(distckpt.ConfigError, match=next(iter(kwargs))):
        distckpt.CheckpointManager(str(tmp_path), **kwargs)


def test_timeouts_as_torch_distributed_takes_them(tmp_path):
    mgr = distckpt.CheckpointManager(str(tmp_path), timeout=datetime.timedelta(minutes=2))
    assert mgr.config.timeout == 120.0


def test_pre_emption_signals_as_names_or_one_signal(tmp_path):
    assert distckpt.CheckpointManager(str(tmp_path), preemption_signals="TERM").config.preemption_signals == (
        signal.SIGTERM,)
    mgr = distckpt.CheckpointManager(str(tmp_path), preemption_signals=("SIGUSR1", signal.SIGTERM))
    assert mgr.config.preemption_signals == (signal.SIGUSR1, signal.SIGTERM)
    mgr.close()


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGBUS", "SIGFPE", "SIGABRT", "SIGCHLD", "SIGPIPE", "SIGWINCH", "SIGCONT",
                                 "SIGTSTP", "SIGPROF"])
def test_signals_that_mean_something_else_are_not_taken_as_notices(tmp_path, sig):
    """SIGSEGV as a notice turned a crash into a hang (the fault recorded, the instruction run
    again); SIGCHLD made a finished `subprocess.run` a pre-emption."""
    with pytest.raises(distckpt.ConfigError, match=f"preemption_signals: {sig} .* not a pre-emption notice"):
        distckpt.CheckpointManager(str(tmp_path), preemption_signals=("SIGTERM", sig))


def test_notice_signals_schedulers_send_are_taken(tmp_path):
    sigs = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGPWR", signal.SIGRTMIN + 2)
    with distckpt.CheckpointManager(str(tmp_path), preemption_signals=sigs) as mgr:
        assert len(mgr.config.preemption_signals) == len(sigs)


@pytest.mark.parametrize("url, match", [
    ("s4://bucket/x", "unknown scheme"), ("S3://bucket/x", "lower case"), ("s3:/bucket/x", "without '//'"),
    ("s3://", "names no bucket"), ("s3:///x", "names no bucket"), ("runs/\x00x", "NUL"), ("", "url"),
    ("file://otherhost/x", "not the host"), (b"runs", "url"), (None, "url"), ("oci://bucket/x", "not installed"),
    ("s3://bkt//dbl//x", "empty path segment"), ("s3://bkt/dbl3//x", "use s3://bkt/dbl3/x"),
    ("memory://a//b", "empty path segment"), ("memory://", "names no directory"), ("memory:///", "names no directory"),
    ("zip://x", "reads an archive file"), ("tar://x/y", "reads an archive file"), ("https://example.com/a", "HTTP"),
    ("github://org:repo@main/x", "read-only"),
])
def test_urls_that_would_land_somewhere_else_are_refused(url, match):
    with pytest.raises(distckpt.ConfigError, match=match):
        distckpt.CheckpointManager(url)


def test_a_host_that_cannot_be_reached_is_a_storage_error_naming_the_url():
    pytest.importorskip("fsspec.implementations.ftp")
    with pytest.raises(distckpt.StorageError, match="ftp://nohost.invalid/y: opening the file system failed"):
        distckpt.CheckpointManager("ftp://nohost.invalid/y")


def test_a_step_directory_given_as_the_root_is_refused_naming_the_root(tmp_path, capsys):
    """Progress.url is a step's directory: a manager there found nothing committed, the run started
    over, and its saves nested inside the committed step."""
    from distckpt.tools import cli
    with distckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(3, {"w": torch.ones(2)})
        step_url = mgr.load_latest({"w": torch.zeros(2)}).url
    for url in (step_url, step_url + "/", f"file://{step_url}"):
        with pytest.raises(distckpt.ConfigError, match=f"is the directory of step 3 inside the checkpoint root "
                                                       f"'{tmp_path}/run'.*load\\(state, step=3\\)"):
            distckpt.CheckpointManager(url)
    with pytest.raises(distckpt.ConfigError, match="local_dir=.*directory of step 3"):
        distckpt.CheckpointManager(str(tmp_path / "other"), local_dir=step_url)
    with pytest.raises(distckpt.ConfigError, match="directory of step 3"):
        distckpt.load_weights(step_url, torch.nn.Linear(1, 1))
    for command in ("ls", "verify", "inspect"):
        assert cli.main([command, step_url]) == 2
        assert "is the directory of step 3" in capsys.readouterr().err
    assert sorted(os.listdir(step_url)) == ["COMMITTED", "manifest.json", "ranks", "replicated"]  # nothing nested


@pytest.mark.parametrize("where", ["inside", "around", "file"])
def test_a_local_tier_inside_or_around_the_url_or_on_a_file_is_refused(tmp_path, where):
    """A local_dir inside the URL was listed by the URL's root as an uncommitted step, and `gc` would
    have removed it though it held the newest checkpoint."""
    url, local = {"inside": (tmp_path / "run", tmp_path / "run" / "local"),
                  "around": (tmp_path / "run" / "durable", tmp_path / "run"),
                  "file": (tmp_path / "run", tmp_path / "a-file")}[where]
    (tmp_path / "a-file").write_text("x")
    match = "is a file" if where == "file" else f"is {where} the checkpoint URL"
    with pytest.raises(distckpt.ConfigError, match=match):
        distckpt.CheckpointManager(str(url), local_dir=str(local))


def test_a_pathlib_path_and_file_urls_are_local_paths(tmp_path):
    assert distckpt.CheckpointManager(tmp_path / "a").storage.url == str(tmp_path / "a")
    assert distckpt.CheckpointManager(f"file://localhost{tmp_path}/b").storage.url == str(tmp_path / "b")
    assert distckpt.CheckpointManager(f"file://{tmp_path}/c").storage.url == str(tmp_path / "c")
    assert isinstance(pathlib.Path(tmp_path), pathlib.Path)


@pytest.mark.parametrize("kwargs, match", [
    ({"step": 1.0}, "step"), ({"step": -1}, "step"), ({"step": True}, "step"), ({"step": "3"}, "step"),
    ({"step": 2**63}, "step"), ({"step": 2**70}, "step"), ({"epoch": 2**64}, "epoch"),
    ({"epoch": 1.5}, "epoch"), ({"metric": "0.5"}, "metric"), ({"metric": True}, "metric"),
    ({"metric": 10**400}, "metric"), ({"metric": math.nan}, "metric"), ({"metric": torch.ones(2)}, "metric"),
])
def test_bad_save_arguments_are_config_errors(tmp_path, kwargs, match):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        args = {"step": 1, **kwargs}
        with pytest.raises(distckpt.ConfigError, match=match):
            mgr.save(args.pop("step"), {"x": 1}, **args)
        assert mgr.committed_steps() == []


def test_metrics_may_be_numpy_numbers_and_one_element_tensors(tmp_path):
    import numpy as np

    with distckpt.CheckpointManager(str(tmp_path), keep_best=1, keep_last=1) as mgr:
        mgr.save(1, {"x": 1}, metric=np.float32(0.5))
        mgr.save(2, {"x": 1}, metric=torch.tensor(0.25))
        with pytest.raises(distckpt.ConfigError, match="metric"):  # was a raw RuntimeError from .item()
            mgr.save(3, {"x": 1}, metric=torch.tensor(1.0, device="meta"))
    assert distckpt.CheckpointManager(str(tmp_path)).committed_steps()[0] == 2


def test_the_largest_int64_step_and_an_intenum_step_come_back_as_plain_ints(tmp_path):
    import enum

    class Phase(enum.IntEnum):
        WARMUP = 3

    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(Phase.WARMUP, {"x": 1}, epoch=Phase.WARMUP)
        mgr.save(2**63 - 1, {"x": 1})
        progress = mgr.load(state := {"x": 0}, step=3)
        assert type(progress.step) is int and type(progress.epoch) is int and state == {"x": 1}
        assert mgr.committed_steps()[0] == 2**63 - 1


def test_keep_best_without_keep_last_says_every_step_is_kept(tmp_path):
    with pytest.warns(distckpt.CheckpointWarning, match="keep_best=1 without keep_last keeps every step"):
        distckpt.CheckpointManager(str(tmp_path), keep_best=1)


def test_numpy_integers_are_taken_wherever_ints_are(tmp_path):
    import numpy as np

    mgr = distckpt.CheckpointManager(str(tmp_path), keep_last=np.int64(2), keep_best=np.int32(1),
                                     leftover_grace_s=np.float32(3.0))  # keep_local, steps took them already
    assert (mgr.config.keep_last, mgr.config.keep_best, mgr.config.leftover_grace_s) == (2, 1, 3.0)
    assert type(mgr.config.keep_last) is int


@pytest.mark.parametrize("url", ["file://", "file:///", "   ", "file://localhost/"])
def test_a_url_naming_the_root_or_only_spaces_is_refused(tmp_path, url):
    with pytest.raises(distckpt.ConfigError, match="url="):
        distckpt.CheckpointManager(url)


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout": "x"}, "timeout"), ({"timeout": float("nan")}, "timeout"), ({"timeout": -1}, "timeout"),
    ({"backend": 5}, "backend"), ({"backend": "bogus"}, "backend")])
def test_init_distributed_checks_its_arguments(kwargs, match):
    with pytest.raises(distckpt.ConfigError, match=match):
        distckpt.init_distributed(**kwargs)


def test_init_distributed_takes_a_timedelta_and_refuses_a_malformed_local_rank(monkeypatch):
    import datetime

    assert distckpt.init_distributed(timeout=datetime.timedelta(seconds=5)).world_size == 1
    monkeypatch.setenv("LOCAL_RANK", "abc")
    with pytest.raises(distckpt.ConfigError, match="LOCAL_RANK"):
        distckpt.init_distributed()


def test_signals_given_as_bytes_are_refused(tmp_path):
    with pytest.raises(distckpt.ConfigError, match="preemption_signals"):  # b"\x0f" was read as SIGTERM
        distckpt.CheckpointManager(str(tmp_path), preemption_signals=b"\x0f")


@pytest.mark.parametrize("step", [5.0, "5", -1, None])
def test_bad_load_steps_are_config_errors(tmp_path, step):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.ConfigError, match="step"):
            mgr.load({}, step)


def test_a_backend_without_exclusive_create_is_said_at_construction(tmp_path):
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class PlainStore(MemoryFileSystem):  # a backend distckpt does not know to create exclusively
        protocol = "plainstore"

    fsspec.register_implementation("plainstore", PlainStore, clobber=True)
    with pytest.warns(NonAtomicStorageWarning, match="PlainStore.*check-then-write"):
        distckpt.CheckpointManager("plainstore://bucket/run")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", NonAtomicStorageWarning)
        distckpt.CheckpointManager("memory://exclusive-here")  # memory:// creates exclusively


@pytest.mark.parametrize("state", [None, [], "model", 3])
def test_a_state_that_is_not_a_dict_is_a_config_error_naming_state(tmp_path, state):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        for call in (lambda: mgr.save(1, state), lambda: mgr.load_latest(state)):
            with pytest.raises(distckpt.ConfigError, match="state=.*must be a dict of entries") as info:
                call()
            assert isinstance(info.value, distckpt.UnstorableValueError)  # what it was before, still
    assert not os.listdir(str(tmp_path)) or "step-000000001" not in os.listdir(str(tmp_path))


@pytest.mark.parametrize("key", [1, None, ("a",), b"model"])
def test_a_state_key_that_is_not_a_str_is_a_config_error_naming_state_on_save_and_load(tmp_path, key):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.ConfigError, match=r"^state=: its key"):
            mgr.load_latest({key: 1})
        with pytest.raises(distckpt.ConfigError, match=r"^state=: its key"):
            mgr.save(1, {key: 1})
        assert mgr.committed_steps() == []


@pytest.mark.parametrize("dataset", [5, None, object()])
def test_with_worker_rng_refuses_what_is_no_dataset(dataset):
    with pytest.raises(distckpt.ConfigError, match="dataset="):  # failed later with a raw TypeError
        distckpt.with_worker_rng(dataset)


def test_config_differences_are_judged_by_type_and_bits(tmp_path, caplog):
    import numpy as np

    saved = {"nan32": np.float32("nan"), "nan": float("nan"), "one": 1, "f": 1, "seq": [1, 2], "zero": 0.0}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"config": saved})
    now = {"nan32": np.float32("nan"), "nan": float("nan"), "one": True, "f": 1.0, "seq": (1, 2), "zero": -0.0}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        progress = mgr.load_latest({"config": now})
    listed = sorted(line.split(":")[0] for line in progress.config_diff)
    assert listed == ["state['config']['f']", "state['config']['one']", "state['config']['seq']",
                      "state['config']['zero']"], progress.config_diff


@pytest.mark.parametrize("key", [2, np.str_("model_cfg"), ("a",), None])
def test_a_state_key_that_is_not_a_plain_str_is_refused_naming_it(tmp_path, key):
    """An np.str_ key was refused by the encoder with an internal path (state['replicated']
    ['entries']), and load_latest accepted it without a word."""
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        for call in (lambda: mgr.save(1, {key: 1}), lambda: mgr.load_latest({key: 1})):
            with pytest.raises(distckpt.ConfigError, match=r"state=: its key .* plain str keys"):
                call()
        assert mgr.committed_steps() == []


HUGE = [10**400, "x" * 100_000, list(range(20_000)), {"k" * 50_000: 1}]


@pytest.mark.parametrize("huge", HUGE, ids=["int", "str", "list", "dict"])
@pytest.mark.parametrize("name", sorted(set(SETTINGS) | {"metric", "step", "epoch", "url", "storage_options",
                                                          "local_dir"}))
def test_a_huge_bad_argument_is_named_in_a_message_of_readable_length(tmp_path, name, huge):
    """metric=10**400 was refused with its 401 digits in the message; a megabyte string, list or
    dict passed where a setting goes was said in full the same way."""
    if name in ("metric", "step", "epoch"):
        with distckpt.CheckpointManager(str(tmp_path)) as mgr:
            args = {"step": 1, name: huge}
            with pytest.raises(distckpt.ConfigError) as caught:
                mgr.save(args.pop("step"), {"x": 1}, **args)
    else:
        kwargs = {"url": huge} if name == "url" else {name: huge}
        url = kwargs.pop("url", str(tmp_path / "root"))
        try:
            distckpt.CheckpointManager(url, **kwargs).close()
            return  # a value this setting takes (keep_last=10**400: keep that many)
        except distckpt.DistCkptError as e:
            caught = pytest.ExceptionInfo.from_exception(e)
    assert isinstance(caught.value, distckpt.ConfigError), caught.value
    assert name in str(caught.value) and len(str(caught.value)) < 1_000, str(caught.value)[:2000]


def test_a_refused_value_under_a_huge_key_is_named_in_a_message_of_readable_length(tmp_path):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError) as caught:
            mgr.save(1, {"config": {"k" * 50_000: {"fn": object()}}})
    message = str(caught.value)
    assert "state['config']['kkkk" in message and "['fn']" in message and len(message) < 1_000, message[:2000]


def _public_calls(tmp_path):
    mgr = distckpt.CheckpointManager(str(tmp_path / "m"))
    return mgr, {
        "CheckpointManager": lambda **kw: distckpt.CheckpointManager(str(tmp_path / "c"), **kw),
        "CheckpointManager.save": lambda **kw: mgr.save(1, {"x": 1}, **kw),
        "CheckpointManager.load_latest": lambda **kw: mgr.load_latest({"x": 1}, **kw),
        "CheckpointManager.load": lambda **kw: mgr.load({"x": 1}, 1, **kw),
        "CheckpointManager.wait": lambda **kw: mgr.wait(**kw),
        "CheckpointManager.committed_steps": lambda **kw: mgr.committed_steps(**kw),
        "CheckpointManager.best_step": lambda **kw: mgr.best_step(**kw),
        "CheckpointManager.close": lambda **kw: mgr.close(**kw),
        "load_weights": lambda **kw: distckpt.load_weights(str(tmp_path / "m"), torch.nn.Linear(1, 1), **kw),
        "export_weights": lambda **kw: distckpt.export_weights(str(tmp_path / "m"), str(tmp_path / "o"), **kw),
        "init_distributed": lambda **kw: distckpt.init_distributed(**kw),
        "per_rank": lambda **kw: distckpt.per_rank({"a": 1}, **kw),
        "with_worker_rng": lambda **kw: distckpt.with_worker_rng([1, 2], **kw),
    }


@pytest.mark.parametrize("call", ["CheckpointManager", "CheckpointManager.save", "CheckpointManager.load_latest",
                                  "CheckpointManager.load", "CheckpointManager.wait",
                                  "CheckpointManager.committed_steps", "CheckpointManager.best_step",
                                  "CheckpointManager.close", "load_weights", "export_weights", "init_distributed",
                                  "per_rank", "with_worker_rng"])
def test_a_keyword_a_call_does_not_take_is_a_config_error_naming_it(tmp_path, call):
    """`CheckpointManager(url, keeplast=2)` raised Python's bare TypeError, although every bad
    argument is said to raise ConfigError. It is an ArgumentNameError now: a ConfigError (and the
    TypeError it was), naming the keyword and the closest parameter."""
    mgr, calls = _public_calls(tmp_path)
    with mgr, pytest.raises(distckpt.ConfigError) as caught:
        calls[call](stepp=1)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, distckpt.ArgumentNameError)
    assert f"{call}() does not take stepp=" in str(caught.value), caught.value


def test_a_misspelled_setting_names_the_setting_it_resembles(tmp_path):
    with pytest.raises(distckpt.ConfigError, match=r"does not take keeplast= \(did you mean keep_last=\?\)"):
        distckpt.CheckpointManager(str(tmp_path), keeplast=2)
    with pytest.raises(distckpt.ConfigError, match="missing a required argument: 'state'"):
        distckpt.CheckpointManager(str(tmp_path)).save(1)
    with pytest.raises(distckpt.ConfigError, match=r"does not take reverse=; it takes no arguments"):
        distckpt.CheckpointManager(str(tmp_path)).committed_steps(reverse=True)


def test_a_type_error_raised_inside_a_checked_call_is_raised_as_it_was():
    from distckpt.config import arguments_checked

    @arguments_checked
    def inner(a: int, *, b: int = 0) -> None:
        raise TypeError("from inside")

    with pytest.raises(TypeError, match="from inside") as caught:
        inner(1, b=2)
    assert not isinstance(caught.value, distckpt.ConfigError)

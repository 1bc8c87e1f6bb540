"""`distckpt doctor`: prove that a training script resumes bit for bit, and name what breaks it.

    distckpt doctor [--kill-at N] [--steps M] [--every K] [--kill-rank R] [--timeout S] [--json] [--workdir DIR] -- <launch command ...>

Runs the user's command unchanged, twice, each into a checkpoint root of its own: every
CheckpointManager of the job uses the root in DISTCKPT_DOCTOR_ROOT instead of its URL (the
override). The first run is uninterrupted. In the second, the rank DISTCKPT_DOCTOR_KILL_RANK
SIGKILLs itself right after the commit of step DISTCKPT_DOCTOR_KILL_AFTER (once: a marker file
records it), and the command is relaunched (or torchrun restarts it, with --max-restarts). Then
every step both runs committed is compared entry by entry, per rank, stream by stream; the
report names the first step that differs, the entries, and the likely cause. Exit 0 iff every
common step is bitwise equal and the killed run resumed. With --every K each run also hashes
every rank's parameters after every K-th optimizer step (a hook on the state's optimizers), so a
difference is located to the optimizer step, between two checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from distckpt.errors import ConfigError, DistCkptError
from distckpt.io.copying import same_bits
from distckpt.protocol.commit import list_committed
from distckpt.protocol.doctor_hooks import (  # noqa: F401  (the doctor's names, shared with the job's side)
    EVERY_ENV,
    FIRST,
    FIRST_PASS_DRAWS,
    KILL_AFTER_ENV,
    KILL_RANK_ENV,
    KILLED_MARK_ENV,
    LOADERS_LEFT_OUT,
    ROOT_ENV,
    STOP_AFTER_ENV,
    WORLD_MARK_ENV,
    fingerprint_root,
    killed_after,
    local_root,
    notes_root,
)
from distckpt.state.kinds import NO_OPTIMIZER_CAUSE, Differing, Job, Kind, Trait, kind_named, registered_kinds
from distckpt.state.replay import REPLAY_KEY
from distckpt.state.streams import PROCESS
from distckpt.storage import open_storage

# -- comparing two runs' checkpoints ---------------------------------------------------------------

@dataclass
class Difference:
    step: int
    where: str      # "replicated" or "rank R"
    entry: str      # top-level key of `state`, or a field of the rank's file ("rng": its process streams)
    path: str       # inside the entry
    detail: str
    kind: str = ""  # the entry's kind as saved ("" for the rank's own fields)


@dataclass
class Report:
    common_steps: list[int]
    only_uninterrupted: list[int]
    only_killed: list[int]
    first_step: int | None
    differences: list[Difference] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    resumed: bool = False
    per_step: dict[int, list[str]] = field(default_factory=dict)  # step -> entries that differ there
    fingerprint_every: int | None = None       # --every K
    first_fingerprint_step: int | None = None  # the first optimizer step whose parameters differ
    fingerprints_taken: bool = False  # --every K found an optimizer in `state` to hook in both runs
    # process streams never drawn from at any compared step in either run (a script that never seeds
    # Python's or NumPy's stream and never uses it): their difference is left out, and named here
    unused_streams: list[str] = field(default_factory=list)
    # loader entries read by workers whose dataset is not wrapped with with_worker_rng (their
    # draws are in no checkpoint, so they never show as a difference of their own)
    unwrapped_worker_loaders: list[str] = field(default_factory=list)
    # each entry of `state` at the first differing step as its kind shows it ("module", "loader", ...;
    # "optimizer" for a torch.optim optimizer, "scheduler" for an LR scheduler)
    entry_kinds: dict[str, str] = field(default_factory=dict)
    # and what each is (Trait values: "weights", "optimizer", "data_position", ...): what the likely
    # causes can tell was left out; and each one's kind as saved ("module", "stateful", ...)
    entry_traits: dict[str, list[str]] = field(default_factory=dict)
    saved_kinds: dict[str, str] = field(default_factory=dict)
    # data loaders in the middle of a pass that no loader in `state` iterated, as the job's first
    # saves found them ("rank R: a loader over X at batch N of M"): their position never travels
    loaders_left_out: list[str] = field(default_factory=list)
    # loaders outside `state` whose persistent workers drew their base seed from torch's global stream
    # at their first pass, as the job's saves found them: a resumed run draws that seed again
    first_pass_draws: list[str] = field(default_factory=list)
    killed_after: int | None = None  # the step whose commit the kill followed (from the mark)
    workdir: str | None = None  # where both runs' roots are kept (None: a temporary one, removed)

    @property
    def compared_after_the_kill(self) -> list[int]:
        """The common steps that prove the resume: committed after the kill, by the relaunch.
        Steps up to the kill were written before it and compare equal whatever the resume does
        (a script saving once, before the kill, passed with nothing after the resume compared)."""
        if self.killed_after is None:
            return list(self.common_steps) if self.resumed else []
        return [step for step in self.common_steps if step > self.killed_after]

    @property
    def unmatched_after_the_kill(self) -> list[int]:
        """Steps after the kill that one run committed and the other did not: the resumed loop ran
        other steps than the uninterrupted one (it trained past where that one stopped, or ended
        early), which "every common step equal" alone called identical."""
        after = -1 if self.killed_after is None else self.killed_after
        return sorted(s for s in set(self.only_uninterrupted) | set(self.only_killed) if s > after) if self.resumed else []

    @property
    def differs(self) -> bool:
        """A compared checkpoint differs, the parameters did (fingerprints, --every), or the runs
        committed different steps after the kill."""
        return (self.first_step is not None or self.first_fingerprint_step is not None
                or bool(self.unmatched_after_the_kill))

    @property
    def identical(self) -> bool:
        return bool(self.compared_after_the_kill) and not self.differs and self.resumed


def compare_roots(reference: str, resumed: str) -> Report:
    """Every step committed in both roots, compared leaf by leaf (tensors by their bytes). A job
    with two tiers also committed into each root's local tier (local_override): both count."""
    where_a, where_b = _committed(reference), _committed(resumed)
    steps_a, steps_b = set(where_a), set(where_b)
    common = sorted(steps_a & steps_b)
    report = Report(common, sorted(steps_a - steps_b), sorted(steps_b - steps_a), None)
    report.loaders_left_out = _read_loaders_left_out([reference, resumed])
    report.first_pass_draws = _read_notes([reference, resumed], FIRST_PASS_DRAWS)
    compared = {step: _compare_step(where_a[step], where_b[step], step) for step in common}
    unused = _unused_streams([streams for _, streams in compared.values()])
    report.unused_streams = [f"{where}: {stream}" for where, stream in sorted(unused)]
    for step, (diffs, _) in compared.items():
        diffs = [d for d in diffs if (d.where, _stream(d)) not in unused]
        report.per_step[step] = sorted({f"{d.where}: {d.entry}" for d in diffs})
        if diffs and report.first_step is None:
            report.first_step, report.differences = step, diffs
            _describe_entries(report, _trees(where_b[step], step))
            report.causes = likely_causes(diffs, report)
    return report


Stream = tuple[str, str]  # (where, "rng/<stream>"): one process stream of one rank
PROCESS_STREAMS = "rng"  # a rank file's field holding its process streams (rng.py)


def _stream(d: Difference) -> str:
    """The process stream a difference is a state of: the rank's own (rng/...), or the copy a
    loader's sampler replay took of a global stream when its epoch started."""
    if d.entry == PROCESS_STREAMS and not d.kind:
        return f"rng/{d.path.split('/')[0]}"
    replayed = _REPLAY_RECORD.search(d.path)
    return f"rng/{_REPLAYED_AS[replayed.group(1)]}" if replayed else ""


# A loader's saved state holds the global streams as its epoch started (replay.py); a stream the
# run never seeds nor draws from differs there between the runs as it does under rng/.
_REPLAYED_AS = {stream.epoch_start_name: stream.name for stream in PROCESS}
_REPLAY_RECORD = re.compile(rf"(?:^|/){re.escape(REPLAY_KEY)}/epoch_start/global/({'|'.join(_REPLAYED_AS)})(?:/|$)")


def _unused_streams(steps: list[tuple[dict[Stream, Any], dict[Stream, Any]]]) -> set[Stream]:
    """The process streams whose state is the same at every compared step in each run but differs
    between the runs: never drawn from after the first checkpoint (draws would move them), so
    nothing they hold reached the training; they differ only because neither run seeded them.
    Two steps at least, or nothing can be told."""
    if len(steps) < 2:
        return set()
    out = set()
    for key in set(steps[0][0]) & set(steps[0][1]):
        a, b = [s[0].get(key, _MISSING) for s in steps], [s[1].get(key, _MISSING) for s in steps]
        if all(_same_leaves(x, a[0]) for x in a) and all(_same_leaves(y, b[0]) for y in b) \
                and not _same_leaves(a[0], b[0]):
            out.add(key)
    return out


def _read_loaders_left_out(roots: list[str]) -> list[str]:
    """What either run's saves noted of loaders left out of `state` (note_loaders_left_out), by rank."""
    return _read_notes(roots, LOADERS_LEFT_OUT)


def _read_notes(roots: list[str], note: str) -> list[str]:
    """What either run's saves noted under `note` (doctor_hooks), by rank."""
    found: set[str] = set()
    for root in roots:
        directory = notes_root(root)
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if name.startswith(f"{note}-rank-") and name.endswith(".txt"):
                rank = name[len(f"{note}-rank-"):-4]
                found.update(f"rank {rank}: {line.strip()}" for line in open(os.path.join(directory, name)) if line.strip())
    return sorted(found)


def compare_fingerprints(reference: str, resumed: str) -> int | None:
    """The first labelled optimizer step at which any rank's parameters differ between the runs
    (a step logged twice by the killed run keeps its last, i.e. the resumed, value)."""
    a, b = _read_fingerprints(fingerprint_root(reference)), _read_fingerprints(fingerprint_root(resumed))
    common = sorted({(r, s) for r in a for s in a[r]} & {(r, s) for r in b for s in b[r]}, key=lambda rs: rs[1])
    return next((s for r, s in common if a[r][s] != b[r][s]), None)


def _read_fingerprints(directory: str) -> dict[int, dict[int, str]]:
    out: dict[int, dict[int, str]] = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("rank-") and name.endswith(".txt"):
            steps = out.setdefault(int(name[5:-4]), {})
            for line in open(os.path.join(directory, name)):
                label, digest = line.split()
                steps[int(label)] = digest
    return out


def _committed(root: str) -> dict[int, Any]:
    """step -> the storage holding it: the root, or its local tier (preferred: every save is there)."""
    out: dict[int, Any] = {}
    for path in (root, local_root(root)):
        if os.path.isdir(path):
            storage = open_storage(path)
            out.update({step: storage for step in list_committed(storage)})
    return out


def _compare_step(a: Any, b: Any, step: int) -> tuple[list[Difference], tuple[dict[Stream, Any], dict[Stream, Any]]]:
    """The differences at `step`, and each run's process streams there (for _unused_streams)."""
    trees_a, trees_b = _trees(a, step), _trees(b, step)
    kinds = {**_saved_kind_names(trees_a), **_saved_kind_names(trees_b)}
    out = []
    for where in sorted(set(trees_a) | set(trees_b)):
        name = where
        left = dict(_leaves(trees_a.get(name, {})))
        right = dict(_leaves(trees_b.get(name, {})))
        for path in sorted(set(left) | set(right)):
            if path in ("step", "epoch", "world_size", "rank"):
                continue
            x, y = left.get(path, _MISSING), right.get(path, _MISSING)
            if not _same(x, y):
                entry, _, inner = path.partition("/")
                kind = ""
                if entry == "entries":
                    entry, _, inner = inner.partition("/")
                    kind = kinds.get((where, entry), "")
                out.append(Difference(step, where, entry, inner, _describe(x, y), kind))
    return out, (_streams(trees_a), _streams(trees_b))


def _saved_records(trees: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(where, key, record) of every saved entry of the step's files."""
    out = []
    for where, tree in trees.items():
        entries = tree.get("entries") if isinstance(tree, dict) else None
        for key, saved in (entries.items() if isinstance(entries, dict) else []):
            if isinstance(saved, dict) and isinstance(saved.get("kind"), str):
                out.append((where, key, saved))
    return out


def _saved_kind_names(trees: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(where, key): saved["kind"] for where, key, saved in _saved_records(trees)}


def _describe_entries(report: Report, trees: dict[str, Any]) -> None:
    """Each saved entry's kind, as shown and as what it is (its traits), from any file that holds
    it; and the entries whose records show draws no checkpoint holds (loader workers over a
    dataset not wrapped with with_worker_rng)."""
    outside: set[str] = set()
    for _, key, saved in _saved_records(trees):
        kind = kind_named(saved["kind"])
        report.saved_kinds[key] = kind.name
        report.entry_kinds[key] = kind.shown_as(saved)
        report.entry_traits[key] = sorted({*report.entry_traits.get(key, []), *(t.value for t in kind.traits(saved))})
        if kind.draws_outside_checkpoint(saved):
            outside.add(key)
    report.unwrapped_worker_loaders = sorted(outside)


def _streams(trees: dict[str, Any]) -> dict[Stream, Any]:
    out = {}
    for where, tree in trees.items():
        rng = tree.get("rng") if isinstance(tree, dict) else None
        for name, value in (rng.items() if isinstance(rng, dict) else []):
            out[(where, f"rng/{name}")] = dict(_leaves(value))
    return out


def _same_leaves(x: Any, y: Any) -> bool:
    return isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)


def _trees(storage: Any, step: int) -> dict[str, Any]:
    """The step's trees by role ("replicated", "rank R", "shards of rank R"): file names carry
    the writer's generation, which differs between the runs by design."""
    from distckpt.tools.inspection import load_trees

    return {_where(name): tree for name, tree in load_trees(storage, step).items()}


def _where(file: str) -> str:
    if file.startswith("ranks/rank-"):
        return f"rank {int(file[len('ranks/rank-'):].split('.')[0])}"
    if file.startswith("shards/rank-"):
        return f"shards of rank {int(file[len('shards/rank-'):].split('.')[0])}"
    return "replicated"


_MISSING = object()


def _leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in _leaves(v, f"{path}/{k}" if path else str(k))]
    if isinstance(value, (list, tuple)) and len(value) > 0 and any(isinstance(v, (dict, list, tuple, torch.Tensor))
                                                                     for v in value):
        return [kv for i, v in enumerate(value) for kv in _leaves(v, f"{path}/{i}")]
    return [(path, value)]


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return same_bits(x, y)
    if isinstance(x, float) and isinstance(y, float):
        return struct.pack("<d", x) == struct.pack("<d", y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y))
    return type(x) is type(y) and x == y


def _describe(x: Any, y: Any) -> str:
    if x is _MISSING or y is _MISSING:
        return "only in the " + ("killed-and-resumed run" if x is _MISSING else "uninterrupted run")
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and x.is_floating_point():
        delta = (x.detach().double() - y.detach().double()).abs()  # a saved hidden state may require grad
        finite = delta[delta.isfinite()]
        return f"{int((delta != 0).sum())} of {x.numel()} elements differ, max |diff| {float(finite.max()) if finite.numel() else math.inf:.3g}"
    if isinstance(x, torch.Tensor):
        return f"tensor {x.dtype}{list(x.shape)} vs {getattr(y, 'dtype', type(y).__name__)}{list(getattr(y, 'shape', []))}"
    return f"{str(x)[:60]} uninterrupted, {str(y)[:60]} resumed"


def likely_causes(diffs: list[Difference], report: Report) -> list[str]:
    """What usually makes these entries differ, and the fix: each differing entry's kind says what
    it usually means (kinds/, `Kind.likely_causes`), in the order the kinds are asked."""
    if report.first_step is not None and report.killed_after is not None and report.first_step <= report.killed_after:
        # both checkpoints were written before the kill: the runs differ on their own, not by the resume
        return [f"the runs already differ at step {report.first_step}, which both wrote before the kill → the script "
                "is not the same run to run (a nondeterministic op, a wall-clock or process-id value in `state`, "
                "randomness never seeded); the resume cannot be judged until two uninterrupted runs agree: seed "
                "everything, torch.use_deterministic_algorithms(True), keep time out of `state`"]
    job = _job(diffs, report)
    # what the job's own saves saw first: only they can see what is not in `state`
    causes = _first_pass_draws(report)
    by_kind: dict[str, list[Differing]] = {}
    for d in diffs:
        if d.kind:
            by_kind.setdefault(d.kind, []).append(Differing(d.where, d.entry, d.path, d.detail))
    if report.fingerprint_every is not None and not report.fingerprints_taken:
        causes.append(NO_OPTIMIZER_CAUSE)
    for kind in _kinds_to_ask(by_kind, job):
        causes += kind.likely_causes(by_kind.get(kind.name, []), job)
    causes += _loaders_left_out(report)
    if any(d.entry == PROCESS_STREAMS and not d.kind for d in diffs):
        causes.append("a process-wide stream (Python, NumPy, torch) differs → something draws random numbers "
                      "at a different point after a resume (a fresh DDP/compile warm-up, an iterator made "
                      "twice); look at what the loop does before its first step")
    if not causes:
        entries = sorted({d.entry for d in diffs})
        causes.append(f"every captured stream equal at the step before, {', '.join(entries)} differ at step "
                      f"{report.first_step} → a random stream outside `state` was drawn in between (a random.Random "
                      "or np.random.Generator instance kept elsewhere, a dataset's own generator), a value the "
                      "loop carries from step to step outside `state` (an RNN's hidden state, a counter gating "
                      "updates such as enumerate(loader)'s index, which restarts at 0 after a resume), or a batch "
                      "drawn before the save; put it in `state` (distckpt.per_rank for per-rank objects)")
    return list(dict.fromkeys(causes))


def _job(diffs: list[Difference], report: Report) -> Job:
    traits = {key: frozenset(Trait(t) for t in values) for key, values in report.entry_traits.items()}
    kinds = {**{d.entry: kind_named(d.kind) for d in diffs if d.kind},
             **{key: kind_named(name) for key, name in report.saved_kinds.items()}}
    return Job(traits=traits, differing={d.entry: traits.get(d.entry, frozenset()) for d in diffs if d.kind},
               first_step=report.first_step, kinds=kinds, draws_outside=frozenset(report.unwrapped_worker_loaders))


def _kinds_to_ask(by_kind: dict[str, list[Differing]], job: Job) -> list[Kind]:
    """The kinds of the differing entries, and those of entries whose records say they draw outside
    any checkpoint, in the order the registry asks them (then any unregistered ones)."""
    wanted = set(by_kind) | {job.kinds[key].name for key in job.draws_outside if key in job.kinds}
    known = [k for k in registered_kinds() if k.name in wanted]
    return known + [kind_named(name) for name in sorted(wanted - {k.name for k in known})]


def _first_pass_draws(report: Report) -> list[str]:
    if not report.first_pass_draws:
        return []
    return [f"a loader outside `state` drew a base seed at its first pass after the resume ({report.first_pass_draws[0]}, "
            "found by the job's own saves: its workers' seed is drawn from torch's global stream at its first pass only, "
            "which the uninterrupted run had behind it) → torch's stream is a draw off from that pass on (dropout, "
            "drop path, augmentation); put it in `state` (a torchdata StatefulDataLoader), or give it a generator of "
            "its own (generator=torch.Generator().manual_seed(...))"]


def _loaders_left_out(report: Report) -> list[str]:
    if not report.loaders_left_out:
        return []
    return [f"`state` holds no loader iterating the training data ({report.loaders_left_out[0]}, found by the job's "
            "own saves) → its position does not travel: a resume takes that pass's batches from its start again "
            "(and a shuffling loader draws its order anew); put the DataLoader in `state`, as a torchdata "
            "StatefulDataLoader (a drop-in replacement whose position is saved)"]


def _check_kill_rank(kill_rank: int | None, world_mark: str) -> None:
    """--kill-rank must name a rank of the job (it was taken modulo the world size: 5 in a world
    of 1 killed rank 0)."""
    if kill_rank is None or not os.path.exists(world_mark):
        return
    with open(world_mark) as f:
        world_size = int(f.read())
    if kill_rank >= world_size:
        raise DistCkptError(f"--kill-rank {kill_rank}: the job has {world_size} rank(s), 0 to {world_size - 1}; "
                            "name one of them (default: the last)")


# -- running the two jobs ----------------------------------------------------------------------------

def run_doctor(command: list[str], kill_at: int | None, kill_rank: int | None = None, workdir: str | None = None,
               timeout: float = 3600.0, steps: int | None = None, every: int | None = None,
               announce: Callable[[str], None] | None = None) -> Report:
    """Both runs and their comparison. A temporary work folder (no `workdir` given) is removed
    when the runs are bitwise identical and kept, its path in the report or the error, when
    they are not or a run failed: its two roots are what `distckpt diff` and `ls` look into."""
    if workdir is not None:
        _refuse_a_used_workdir(workdir)
        report = _run_both(command, kill_at, kill_rank, workdir, timeout, steps, every, announce)
        report.workdir = workdir
        return report
    temporary = tempfile.mkdtemp(prefix="distckpt-doctor-")
    try:
        report = _run_both(command, kill_at, kill_rank, temporary, timeout, steps, every, announce)
    except DistCkptError as e:
        raise DistCkptError(f"{e}\n(both runs' roots are kept in {temporary}; remove it when done)") from e
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)  # Ctrl-C: nothing to look into
        raise
    if report.identical:
        shutil.rmtree(temporary, ignore_errors=True)
    else:
        report.workdir = temporary
    return report


def _refuse_a_used_workdir(workdir: str) -> None:
    """Both runs resume from what their roots hold: in a folder of an earlier doctor run the
    "uninterrupted" run resumed from that run's steps and no kill happened, and a script whose
    resume is not exact was reported bitwise identical."""
    if os.path.isdir(workdir) and os.listdir(workdir):
        raise ConfigError(f"--workdir {workdir}: the folder is not empty (an earlier doctor run's roots?): both runs "
                          "would resume from what it holds; give a new or empty folder, or remove it")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir {workdir}: a file, not a folder")


def _run_both(command: list[str], kill_at: int | None, kill_rank: int | None, workdir: str, timeout: float,
              steps: int | None, every: int | None, announce: Callable[[str], None] | None) -> Report:
    reference, killed = os.path.join(workdir, "uninterrupted"), os.path.join(workdir, "killed")
    mark = os.path.join(workdir, "killed.mark")
    stop = {STOP_AFTER_ENV: str(steps)} if steps is not None else {}
    if every is not None:
        stop[EVERY_ENV] = str(every)
    world_mark = os.path.join(workdir, "world-size")
    _run(command, {ROOT_ENV: reference, WORLD_MARK_ENV: world_mark, **stop}, timeout, "the uninterrupted run",
         announce=announce)
    _check_kill_rank(kill_rank, world_mark)
    env = {ROOT_ENV: killed, KILL_AFTER_ENV: FIRST if kill_at is None else str(kill_at), KILLED_MARK_ENV: mark, **stop}
    if kill_rank is not None:
        env[KILL_RANK_ENV] = str(kill_rank)
    first = _run(command, env, timeout, "the killed run", check=False, announce=announce)
    if first.returncode != 0 and os.path.exists(mark):
        _run(command, env, timeout, "the relaunch after the kill", announce=announce)  # torchrun did not restart it
    elif first.returncode != 0:
        raise DistCkptError(f"the killed run failed before step {kill_at} was committed:\n{first.stderr[-2000:]}")
    report = compare_roots(reference, killed)
    report.resumed = os.path.exists(mark)
    report.killed_after = killed_after(mark)
    if every is not None:
        report.fingerprint_every = every
        report.first_fingerprint_step = compare_fingerprints(reference, killed)
        report.fingerprints_taken = all(_read_fingerprints(fingerprint_root(r)) for r in (reference, killed))
        if report.first_fingerprint_step is not None:
            report.causes.insert(0, f"the parameters first differ after optimizer step {report.first_fingerprint_step} "
                                    f"(fingerprints every {every} steps): look at what that step and the one "
                                    "before do differently after a resume")
    return report



# A rank's line may carry torchrun's "[rank1]: " prefix (its log options); the exception is after it.
_EXCEPTION_LINE = re.compile(r"^(?:\[(?:default)?rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*"
                             r"(?:Error|Exception|Interrupt|Exit)\b:? .*)$", re.MULTILINE)
# torchrun's own report that a rank failed: worth naming only when no rank's exception was found
_LAUNCHER_FAILURE = "ChildFailedError"


def _failure(what: str, detail: str, stdout: str, stderr: str) -> DistCkptError:
    """The error for a run that failed or hung: its header, the exceptions it raised (their
    lines, wherever they are in the output: a long traceback after them pushed them out of the
    tail), then the tail of its output."""
    raised = _raised(stdout, stderr)
    lines = [f"{what} {detail}"]
    if raised:
        lines.append("raised: " + " | ".join(line[:300] for line in raised[:4]))
    lines.append(f"its last output:\n{stdout[-1500:]}\n{stderr[-3000:]}")
    return DistCkptError("\n".join(lines))


def _raised(stdout: str, stderr: str) -> list[str]:
    """The exceptions a run's output shows, each once, in order; the ranks' own first (torchrun's
    ChildFailedError last, and only when nothing else was raised)."""
    found = list(dict.fromkeys(m.group(1).strip() for m in _EXCEPTION_LINE.finditer(stderr + "\n" + stdout)))
    own = [line for line in found if _LAUNCHER_FAILURE not in line]
    return own or found


def _run(command: list[str], extra: dict[str, str], timeout: float, what: str, check: bool = True,
         announce: Callable[[str], None] | None = None) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run the launch command in a session of its own: at the deadline the whole session goes
    (torchrun, its ranks and their loader workers), and the error says which run hung and how
    far it got (a job hung at exit waited silently for the caller's whole timeout)."""
    env = {**os.environ, **extra}
    if announce is not None:
        announce(f"{what}: {' '.join(command)}")
    hung = False
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            _kill_session(child)
            stdout, stderr = child.communicate()
        except BaseException:  # Ctrl-C: the job's own session does not get the terminal's signal
            _kill_session(child)
            raise
    if hung:
        raise _failure(what, f"did not end within {timeout:g}s (--timeout): it hung (at exit, or in a step), "
                             "so it was killed with its ranks", stdout, stderr)
    result = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise _failure(what, f"exited {result.returncode}", result.stdout, result.stderr)
    return result


def _kill_session(child: subprocess.Popen) -> None:  # type: ignore[type-arg]
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def report_text(report: Report) -> str:
    lines = [f"steps committed by both runs: {report.common_steps}"]
    if report.only_uninterrupted or report.only_killed:
        lines.append(f"only uninterrupted: {report.only_uninterrupted}; only killed-and-resumed: {report.only_killed}")
    if not report.resumed:
        lines.append("the killed run was never killed: the kill follows the commit of the step --kill-at names, and "
                     "that run committed no such step (name a step the job saves and reaches; `distckpt ls` on "
                     "the uninterrupted run's root lists them): nothing was proven")
    elif report.common_steps and not report.compared_after_the_kill:
        lines.append(f"no step committed by both runs after the kill (after step {report.killed_after}): the resumed "
                     "run's checkpoints were not compared; save at least once after the step killed at")
    if report.per_step:
        lines.append(f"{'step':>8}  {'uninterrupted vs killed-and-resumed'}")
        for step, entries in report.per_step.items():
            shown = ", ".join(entries[:6]) + (f", ... ({len(entries)} in all)" if len(entries) > 6 else "")
            lines.append(f"{step:>8}  " + (f"differs: {shown}" if entries else "bitwise identical"))
    if report.fingerprint_every is not None and not report.fingerprints_taken:
        lines.append(f"parameter fingerprints every {report.fingerprint_every} optimizer steps: none taken — no "
                     "torch.optim optimizer in `state` to hook (a loop that steps its parameters by hand); "
                     "only the checkpoints were compared")
    elif report.fingerprint_every is not None:
        lines.append(f"parameter fingerprints every {report.fingerprint_every} optimizer steps: " + (
            "equal at every common step" if report.first_fingerprint_step is None
            else f"first differ after step {report.first_fingerprint_step}"))
    if report.unused_streams:
        lines.append(f"left out: {', '.join(report.unused_streams)} — never seeded and never drawn from (the same at "
                     "every step of each run, different between the runs); seed them to have them compared")
    if report.first_step is None and report.first_fingerprint_step is not None:
        lines.append(f"VERDICT: differs — the parameters first differ after optimizer step "
                     f"{report.first_fingerprint_step} (no compared checkpoint differs)")
        lines += ["likely cause:"] + [f"  {c}" for c in report.causes]
        return "\n".join(lines + _kept(report))
    if report.first_step is None and report.unmatched_after_the_kill:
        lines.append(f"VERDICT: differs — the runs committed different steps after the kill (only uninterrupted: "
                     f"{report.only_uninterrupted}; only killed-and-resumed: {report.only_killed}): the resumed loop "
                     "did not run the steps the uninterrupted one ran; a step counter, a stopping rule or a save "
                     "schedule kept outside `state` (or not read back from it after the load) is the usual cause")
        return "\n".join(lines + _kept(report))
    if report.first_step is None:
        lines.append("VERDICT: bitwise identical at every common step" if report.identical else "VERDICT: not proven")
        return "\n".join(lines + _kept(report))
    lines.append(f"VERDICT: differs — first at step {report.first_step}")
    lines.append(f"{'where':<16} {'entry':<18} {'path':<40} detail")
    for d in report.differences[:30]:
        lines.append(f"{d.where:<16} {d.entry:<18} {d.path:<40} {d.detail}")  # a long path whole: it names the parameter
    if len(report.differences) > 30:
        lines.append(f"... and {len(report.differences) - 30} more")
    lines += ["likely cause:"] + [f"  {c}" for c in report.causes]
    return "\n".join(lines + _kept(report))


def _kept(report: Report) -> list[str]:
    """Where the two roots are, for a look at what differs (a folder of the doctor's own is removed
    when the runs are identical, so this names only one worth looking into or the user's own)."""
    if report.workdir is None:
        return []
    step = f" --step {report.first_step}" if report.first_step is not None else ""
    return [f"both runs' roots are kept: {os.path.join(report.workdir, 'uninterrupted')} and "
            f"{os.path.join(report.workdir, 'killed')} (distckpt inspect ROOT{step}; remove "
            f"{report.workdir} when done)"]


def report_json(report: Report) -> str:
    data = asdict(report)
    data["identical"] = report.identical
    data["differs"] = report.differs
    data["compared_after_the_kill"] = report.compared_after_the_kill
    return json.dumps(data, default=str)

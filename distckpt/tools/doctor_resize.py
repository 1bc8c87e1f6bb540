"""`distckpt doctor --resize M`: does an elastic resume feed every sample of the interrupted
epoch exactly once, and how far does the loss curve move?

    distckpt doctor --resize M [--kill-at N] [--kill-rank R] -- torchrun --nproc-per-node N train.py ...

Three runs of the user's command, each recording its steps with `distckpt.doctor_record(step,
epoch=..., samples=..., loss=...)` (a no-op outside the doctor): uninterrupted at N ranks; at N
ranks, a rank SIGKILLed right after the commit of step --kill-at (the first commit by default);
then the command with --nproc-per-node M, which resumes from that step (the job's manager is
built with world_size_policy="elastic"). The report accounts for the interrupted epoch's samples
(the killed run's steps up to the checkpoint, then the resumed run's) against the uninterrupted
run's epoch, checks the next epoch, and compares the per-step mean losses. Another world size
cannot be bitwise equal: gradients are averaged over M ranks in another order, and each step
groups other samples.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from distckpt.errors import ConfigError, DistCkptError
from distckpt.protocol.doctor_hooks import (
    FIRST,
    KILL_AFTER_ENV,
    KILL_RANK_ENV,
    KILLED_MARK_ENV,
    ROOT_ENV,
    SAMPLES_ENV,
    killed_after,
)

_NPROC = re.compile(r"--nproc[-_]per[-_]node(=(\d+))?")


@dataclass
class ResizeReport:
    old_world: int
    new_world: int
    resumed_from: int | None
    epoch: int | None                     # the interrupted epoch
    epoch_samples: int = 0                # samples the uninterrupted run's epoch fed
    missed: dict[int, int] = field(default_factory=dict)    # sample -> times fewer than uninterrupted
    repeated: dict[int, int] = field(default_factory=dict)  # sample -> times more
    next_epoch_complete: bool | None = None  # the epoch after: every sample of the uninterrupted one, as often
    loss_before_equal: bool = False       # the steps up to the checkpoint: the same losses (same world)
    loss_max_abs_diff: float | None = None  # over the common steps after the resume
    loss_mean_by_epoch: dict[int, tuple[float, float]] = field(default_factory=dict)  # uninterrupted, resized
    records: bool = True                  # the job called distckpt.doctor_record
    workdir: str | None = None

    @property
    def exactly_once(self) -> bool:
        """None missed, and repeats no more than the padding the rule allows (M-1)."""
        return self.records and not self.missed and sum(self.repeated.values()) <= self.new_world - 1


def resized_command(command: list[str], new_world: int) -> tuple[list[str], int]:
    """The launch command with --nproc-per-node M, and the N it had."""
    out, old = list(command), None
    for i, arg in enumerate(out):
        found = _NPROC.fullmatch(arg)
        if found and found.group(2):
            old, out[i] = int(found.group(2)), f"--nproc-per-node={new_world}"
            break
        if found and i + 1 < len(out) and out[i + 1].isdigit():
            old, out[i + 1] = int(out[i + 1]), str(new_world)
            break
    if old is None:
        raise ConfigError("--resize: the launch command has no --nproc-per-node N (torchrun's) to change; "
                          "give the torchrun command the job runs with")
    return out, old


def run_resize(command: list[str], new_world: int, kill_at: int | None, kill_rank: int | None,
               workdir: str | None, timeout: float, run: Callable[..., Any],
               announce: Callable[[str], None] | None = None) -> ResizeReport:
    """The three runs and the report; `run` is the doctor's runner (doctor._run)."""
    resized, old_world = resized_command(command, new_world)
    folder = workdir or tempfile.mkdtemp(prefix="distckpt-doctor-resize-")
    ref, killed, mark = (os.path.join(folder, n) for n in ("uninterrupted", "killed", "killed.mark"))
    run(command, {ROOT_ENV: ref, SAMPLES_ENV: ref + "-samples"}, timeout, "the uninterrupted run", announce=announce)
    env = {ROOT_ENV: killed, SAMPLES_ENV: killed + "-samples", KILLED_MARK_ENV: mark,
           KILL_AFTER_ENV: FIRST if kill_at is None else str(kill_at)}
    if kill_rank is not None:
        env[KILL_RANK_ENV] = str(kill_rank)
    run(command, env, timeout, f"the killed run ({old_world} ranks)", check=False, announce=announce)
    if not os.path.exists(mark):
        raise DistCkptError(f"the killed run ended without the kill after step {kill_at}: no step was committed "
                            "there (is --kill-at a step the job saves?)")
    run(resized, {ROOT_ENV: killed, SAMPLES_ENV: killed + "-resumed-samples"}, timeout,
        f"the resumed run ({new_world} ranks)", announce=announce)
    report = account(_read(ref + "-samples"), _read(killed + "-samples"), _read(killed + "-resumed-samples"),
                     killed_after(mark), old_world, new_world)
    if workdir is None and report.exactly_once:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        report.workdir = folder
    return report


Records = list[dict[str, Any]]  # doctor_record lines, each with its rank


def account(reference: Records, killed: Records, resumed: Records, resumed_from: int | None,
            old_world: int, new_world: int) -> ResizeReport:
    """The sample accounting and the loss comparison of the three runs' records."""
    report = ResizeReport(old_world, new_world, resumed_from, None)
    if not reference or not resumed or resumed_from is None:
        report.records = False
        return report
    before = [r for r in killed if r["step"] <= resumed_from]
    epoch = next((r["epoch"] for r in before if r["step"] == resumed_from), None)
    report.epoch = epoch
    ref_epoch = _samples(reference, epoch)
    got = _samples(before, epoch) + _samples(resumed, epoch)
    report.epoch_samples = sum(ref_epoch.values())
    report.missed = dict(sorted((ref_epoch - got).items()))
    report.repeated = dict(sorted((got - ref_epoch).items()))
    following = _samples(reference, None if epoch is None else epoch + 1)
    if following:
        report.next_epoch_complete = set(_samples(resumed, epoch + 1)) == set(following)  # type: ignore[operator]
    ref_loss, killed_loss, resumed_loss = _losses(reference), _losses(before), _losses(resumed)
    report.loss_before_equal = all(ref_loss.get(s) == v for s, v in killed_loss.items())
    after = [s for s in resumed_loss if s in ref_loss]
    if after:
        report.loss_max_abs_diff = max(abs(ref_loss[s] - resumed_loss[s]) for s in after)
    for e in sorted({r["epoch"] for r in reference}):
        ref_mean = _mean([r["loss"] for r in reference if r["epoch"] == e and r["loss"] is not None])
        got_mean = _mean([r["loss"] for r in before + resumed if r["epoch"] == e and r["loss"] is not None])
        if ref_mean is not None and got_mean is not None:
            report.loss_mean_by_epoch[e] = (ref_mean, got_mean)
    return report


def _samples(records: Records, epoch: int | None) -> collections.Counter:
    return collections.Counter(s for r in records if r["epoch"] == epoch for s in r["samples"])


def _losses(records: Records) -> dict[int, float]:
    """Each step's loss averaged over the ranks that recorded it."""
    by_step: dict[int, list[float]] = collections.defaultdict(list)
    for r in records:
        if r["loss"] is not None:
            by_step[r["step"]].append(r["loss"])
    return {s: sum(v) / len(v) for s, v in by_step.items()}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _read(folder: str) -> Records:
    out: Records = []
    if not os.path.isdir(folder):
        return out
    for name in sorted(os.listdir(folder)):
        rank = int(name[len("rank-"):-len(".jsonl")])
        with open(os.path.join(folder, name)) as f:
            out.extend({**json.loads(line), "rank": rank} for line in f if line.strip())
    return out



def resize_text(report: ResizeReport) -> str:
    if not report.records:
        return ("distckpt doctor --resize: no step records: call distckpt.doctor_record(step, epoch=epoch, "
                "samples=batch_indices, loss=loss.item()) once per step in the job (docs: guides/elastic.md)")
    lines = [f"{report.old_world} ranks killed after the commit of step {report.resumed_from} (epoch {report.epoch}), "
             f"resumed at {report.new_world} ranks",
             f"interrupted epoch {report.epoch}: {report.epoch_samples} samples in the uninterrupted run; "
             f"{sum(report.missed.values())} missed, {sum(report.repeated.values())} repeated"
             + (" (the padding of at most M-1 when the rest does not divide by M)" if report.repeated and
                report.exactly_once else "")]
    if report.missed:
        lines.append(f"  missed: {list(report.missed)[:20]}")
    if report.repeated:
        lines.append(f"  repeated: {list(report.repeated)[:20]}")
    if report.next_epoch_complete is not None:
        lines.append(f"next epoch: {'every sample' if report.next_epoch_complete else 'NOT every sample'} "
                     "of the uninterrupted run's")
    lines.append(f"losses up to the checkpoint: {'identical' if report.loss_before_equal else 'DIFFER'} "
                 f"({report.old_world} ranks in both runs)")
    if report.loss_max_abs_diff is not None:
        lines.append(f"losses after the resume: largest difference per step {report.loss_max_abs_diff:.3g}")
    for e, (a, b) in report.loss_mean_by_epoch.items():
        lines.append(f"  epoch {e}: mean loss {a:.6g} uninterrupted, {b:.6g} resized ({b - a:+.3g})")
    lines.append("numerics: another world size is never bitwise equal (gradients averaged over another number of "
                 "ranks, in another order; each step groups other samples); the data is what is exact")
    lines.append("OK: every sample of the interrupted epoch exactly once" if report.exactly_once
                 else "PROBLEM: the interrupted epoch was not fed exactly once")
    if report.workdir:
        lines.append(f"(the runs' roots and records are kept in {report.workdir})")
    return "\n".join(lines)


def resize_json(report: ResizeReport) -> str:
    return json.dumps({**asdict(report), "exactly_once": report.exactly_once}, indent=2, default=str)

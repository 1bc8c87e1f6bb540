"""The `distckpt` command line: read and tidy checkpoints with exactly the loader's rules.

    distckpt ls URL [--local-dir D] [--json]          committed steps, and uncommitted leftovers
    distckpt inspect URL [--step N] [--local-dir D] [--json]   manifest, versions, ranks, config, tensors
    distckpt verify URL [--step N | --all] [--local-dir D] [--json]   sizes, checksums, structure
                      (--local-dir: a two-tier job's local tier as well, each row saying which)
    distckpt prune URL --keep-last N [--keep-best K] [--best-mode min|max] [--dry-run]
    distckpt gc URL [--grace-s S] [--dry-run]         uncommitted leftovers, abandoned uploads
    distckpt diff URL A B [--json]                    what changed between steps A and B
    distckpt doctor [--kill-at N] [--steps M] [--every K] [--kill-rank R] [--timeout S] [--json] -- <launch command>
                                                      does the job resume bit for bit? names what breaks it
    distckpt import-torch FILE URL --trust-pickle [--world-size N] [--step S]   a torch.save file in
    distckpt import-dcp DCP_DIR URL --trust-pickle [--world-size N] [--step S]  a DCP checkpoint in
    distckpt export URL OUT_DIR [--step N] [--entry model] [--dtype bf16] [--max-shard-size 5GB] [--json]
                                                      the model as Hugging Face safetensors, verified

Exit codes: 0 success; 1 a problem was found (verify) or nothing to show; 2 bad usage, a root
that does not exist, or storage that cannot be read. With --json every outcome, errors included,
is one JSON document on stdout ({"error": ..., "exit_code": ...} for errors; non-finite floats
as the strings "nan", "inf", "-inf"). S3 credentials and endpoint come from the AWS_* environment.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Iterator, NoReturn

from distckpt.errors import ConfigError, CorruptCheckpointError, DistCkptError, StorageError, SupersededCheckpointError
from distckpt.io import manifest as mf
from distckpt.protocol.commit import (
    CommitIndex,
    check_not_superseded,
    list_committed,
    read_marker,
    step_candidates,
)
from distckpt.protocol.fencing import Lease, newest_commit_record, read_leases, resumed_leases
from distckpt.protocol.retention import (
    collect_leftovers,
    delete_checkpoint,
    kept_references,
    plan_retention,
    read_committed,
    superseded_to_retire,
)
from distckpt.runtime.gcpause import collector_paused
from distckpt.storage import Storage, open_storage
from distckpt.tools.inspection import describe_step, diff_steps, list_steps, marker_may_stand, read_manifest, verify_step

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(_json_safe(data), indent=1, default=str, allow_nan=False) if args.json else text)


def _json_safe(value: Any) -> Any:
    """JSON has no NaN or Infinity: they become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    """An error: one JSON document on stdout with --json, a line on stderr without."""
    if getattr(args, "json", False):
        print(json.dumps({"command": getattr(args, "command", None), "error": message, "exit_code": code}))
    else:
        print(f"distckpt {getattr(args, 'command', '')}: {message}", file=sys.stderr)
    return code


def _tiers(storage: Storage, args: argparse.Namespace) -> list[tuple[str, Storage]]:
    """The roots a command reads: the URL, and with --local-dir the local tier too (a manager's
    local_dir=; the same rules, the same layout)."""
    tiers = [("durable", storage)]
    if getattr(args, "local_dir", None):
        if not os.path.isdir(args.local_dir):
            raise ConfigError(f"--local-dir {args.local_dir}: no such directory (the job's local_dir on this node)")
        tiers.append(("local", open_storage(args.local_dir)))
    return tiers


def cmd_ls(storage: Storage, args: argparse.Namespace) -> int:
    rows = []
    tiers = _tiers(storage, args)
    for tier, root in tiers:
        for s in list_steps(root):
            m = s.manifest
            row = {"step": s.step, "status": s.status, "epoch": m and m.epoch, "metric": m and m.metric,
                   "world_size": m and m.world_size, "created_unix": m and m.created_unix,
                   "bytes": m and m.owned_bytes,
                   # incremental: bytes of older steps' files it references (stored once, there)
                   "shared_bytes": m and m.shared_bytes}
            rows.append({**row, "tier": tier} if len(tiers) > 1 else row)
    if len(tiers) > 1:
        rows.sort(key=lambda r: (r["step"], r["tier"] == "local"))
    shared = any(r.get("shared_bytes") for r in rows)  # incremental: a column of what steps reference
    lines = [f"{'step':>10} {'epoch':>6} {'world':>5} {'bytes':>12} " + (f"{'shared':>12} " if shared else "")
             + f"{'metric':>12} {'created':>20}  status" + ("  tier" if len(tiers) > 1 else "")]
    for r in rows:
        stamp = r["created_unix"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if isinstance(stamp, (int, float)) else ""
        lines.append(f"{r['step']:>10} {_s(r['epoch']):>6} {_s(r['world_size']):>5} {_s(r['bytes']):>12} "
                     + (f"{_s(r['shared_bytes']):>12} " if shared else "")
                     + f"{_s(r['metric']):>12} {created:>20}  {r['status']}" + (f"  {r['tier']}" if "tier" in r else ""))
    if not any(str(r["status"]).startswith(("committed", "superseded")) for r in rows):
        resumed = resumed_leases(read_leases(storage))
        record = None if resumed else newest_commit_record(storage)
        if resumed:  # what load_latest raises about: the run's history is gone
            lines.append(f"no committed step, but {resumed[-1].describe()} had resumed from one: this run's "
                         "checkpoints are gone, and load_latest refuses to start it over silently")
        elif record is not None:
            lines.append(f"no committed step, but generation {record['generation']} committed one here: this run's "
                         "checkpoints are gone, and load_latest refuses to start it over silently")
    _emit(args, rows, "\n".join(lines))
    return EXIT_OK


def _s(value: Any) -> str:
    return "" if value is None else str(value)


def _steps(storage: Storage, args: argparse.Namespace) -> list[int]:
    if getattr(args, "all", False):  # as `ls` lists them: a damaged or unreadable step included
        return sorted(s.step for s in list_steps(storage) if not s.status.startswith(("uncommitted", "retired")))
    if args.step is not None:
        return [args.step]
    # The newest step as load_latest sees it (a directory whose marker stands), not as the
    # whole-root listing does: that listing does not follow a step directory replaced by a
    # symbolic link, so verify said the step below "ok" while `ls` listed the newest as damaged
    # and load_latest fell back past it.
    standing = (step for step in step_candidates(storage) if marker_may_stand(storage, step))
    return list(itertools.islice(standing, 1))


def _in_load_order(storage: Storage, leases: list[Lease]) -> Iterator[tuple[bool, int]]:
    """(superseded, step) of the committed steps in the order load_latest tries them: newest
    first, a superseded writer's output after every other step (its last resort). Lazy: the
    markers are read only as far as the caller goes."""
    superseded = []
    for step in list_committed(storage):
        try:
            check_not_superseded(read_marker(storage, step), leases, f"{storage.url}/{mf.step_dir(step)}")
        except SupersededCheckpointError:
            superseded.append(step)
            continue
        except (DistCkptError, OSError):
            pass  # damaged: tried in its place (and passed over if unreadable)
        yield False, step
    for step in superseded:
        yield True, step


_INSPECT_TRIES = 8  # steps per tier inspect tries before it gives up (each unreadable one is said)


def _refuse_an_uncommitted_step(storage: Storage, args: argparse.Namespace) -> int | None:
    """--step N that no tier has committed (pruned, never saved) is said as such, as diff and export
    say it, not as a missing COMMITTED file (verify called it BAD)."""
    if args.step is None or any(args.step in list_committed(root) for _, root in _tiers(storage, args)):
        return None
    if marker_may_stand(storage, args.step):
        return None  # a marker no listing shows (a directory stands there): verify and inspect say what is wrong
    committed = list_committed(storage)
    return _fail(args, f"step {args.step} is not committed at {storage.url} (committed: {committed[:10]})", EXIT_USAGE)


def cmd_inspect(storage: Storage, args: argparse.Namespace) -> int:
    refused = _refuse_an_uncommitted_step(storage, args)
    if refused is not None:
        return refused
    leases = read_leases(storage) if args.step is None else []

    def steps_of(root: Storage) -> list[tuple[bool, int]]:
        if args.step is not None:
            return [(False, step) for step in _steps(root, args)]
        in_order = list(itertools.islice(_in_load_order(root, leases), _INSPECT_TRIES))
        # The newest entry spelled like a step whose marker may stand, as load_latest tries it: the
        # root listing does not follow a step directory replaced by a symbolic link (nor shows a
        # file standing there), and inspect described the step below without a word of it
        newest = _steps(root, args)
        if newest and newest[0] not in {step for _, step in in_order}:
            in_order.insert(0, (False, newest[0]))
        return in_order

    found = [(superseded, step, tier, root) for tier, root in _tiers(storage, args)
             for superseded, step in steps_of(root) if args.step is None or step in list_committed(root)] or \
        [(superseded, step, "durable", storage) for superseded, step in steps_of(storage)]
    if not found:
        return _fail(args, f"no committed checkpoint at {storage.url}", EXIT_PROBLEM)
    found.sort(key=lambda f: (not f[0], f[1], f[2] == "local"), reverse=True)  # newest; the local copy first
    for index, (_, step, _, storage) in enumerate(found):
        try:
            d = describe_step(storage, step)
            break
        except (CorruptCheckpointError, StorageError) as e:
            # Without --step, the newest step it can read, as export and load_weights fall back
            # (describing reads headers and manifests, not every byte: `verify` checks those).
            if args.step is not None or index == len(found) - 1 or \
                    (type(e) is StorageError and e.errno != errno.ELOOP):
                raise
            print(f"distckpt inspect: step {step} at {storage.url} cannot be read ({e}); "
                  "describing the previous one", file=sys.stderr)
    tier = found[index][2]
    if getattr(args, "local_dir", None):
        d["tier"] = tier
    m = d["manifest"]
    lines = [f"step {m['step']}  epoch {m['epoch']}  metric {m['metric']}  world size {m['world_size']}  run {m['run_id']}"
             + (f"  ({tier} tier)" if getattr(args, "local_dir", None) else ""),
             "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
             f"config: {json.dumps(d['config'])}", "ranks:"]
    for r, info in zip(d["ranks"], m["ranks"]):
        lines.append(f"  rank {r['rank']} on {info['host']}: epoch {r['epoch']}, RNG streams {r['rng_streams']}")
        lines += [f"    {k}: {json.dumps(v, default=str)}" for k, v in r["entries"].items()]
    lines.append("entries: " + ", ".join(f"{k} ({v['kind']}, {v['scope']})" for k, v in m["entries"].items()))
    lines.append(f"bytes: {d['bytes_owned']:,} in this step's files"
                 + (f", {d['bytes_shared']:,} in files of older steps it references (incremental)"
                    if d["bytes_shared"] else ""))
    lines.append(f"tensors ({len(d['tensors'])}, {sum(t['bytes'] for t in d['tensors']):,} bytes):")
    lines += [f"  {t['name']:<56} {t['dtype']:>5} {str(t['shape']):>18} {t['bytes']:>12,}"
              + (f"  from {t['shared_from']}" if "shared_from" in t else "") for t in d["tensors"]]
    table = m.get("sharded") or {}
    if table:
        lines.append(f"sharded tensors ({len(table)}; pieces in {len({c['file'] for e in table.values() for c in e['chunks']})} shard files):")
        lines += [f"  {name:<56} {e['dtype']:>5} {str(e['shape']):>18} {len(e['chunks']):>5} chunks"
                  for name, e in table.items()]
    _emit(args, d, "\n".join(lines))
    return EXIT_OK


_VERIFY_LISTINGS = 3  # plain `verify` lists again when the newest step was removed while it was verified


def cmd_verify(storage: Storage, args: argparse.Namespace) -> int:
    refused = _refuse_an_uncommitted_step(storage, args)
    if refused is not None:
        return refused
    tiers = _tiers(storage, args)
    leases = read_leases(storage)  # the durable root's leases judge both tiers (tiers.py)
    rows: list[dict[str, Any]] = []
    for _ in range(_VERIFY_LISTINGS):
        todo = [(tier, root, step) for tier, root in tiers for step in _steps(root, args)
                if len(tiers) == 1 or args.step is None or step in list_committed(root)]
        if not todo:
            return _fail(args, f"no committed checkpoint at {storage.url}", EXIT_PROBLEM)
        for tier, root, step in todo:
            # A superseded writer's step named with --step is refused, as load(state, step) refuses
            # it; listed (plain, --all) it is the loader's last resort, damaged only if its files are.
            superseded: list[str] | None = [] if args.step is None else None
            with _progress(root, [step]) as bar:
                problems = verify_step(root, step, bar.update, leases, superseded)
            if problems and args.step is None and not marker_may_stand(root, step):
                continue  # a running writer's retention took it while it was read: not damage
                # (a file standing where the step's directory goes stays damage, as `ls` says)
            rows.append({"step": step, "ok": not problems, "problems": problems,
                         "superseded": superseded[0] if superseded else None,
                         **({"tier": tier} if len(tiers) > 1 else {})})
        if rows:
            break
    if not rows:
        return _fail(args, f"every committed step at {storage.url} was removed while it was verified (a running "
                     "writer's retention); run it again", EXIT_PROBLEM)
    label = (lambda r: f"step {r['step']} ({r['tier']})") if len(tiers) > 1 else (lambda r: f"step {r['step']}")
    lines = [f"{label(r)}: ok" + (f" (superseded, loaded only as the last resort: {r['superseded']})" if r["superseded"] else "")
             if r["ok"] else f"{label(r)}: BAD\n" + "\n".join(f"  {x}" for x in r["problems"])
             for r in rows]
    _emit(args, rows, "\n".join(lines))
    return EXIT_PROBLEM if any(not r["ok"] for r in rows) else EXIT_OK


def _progress(storage: Storage, steps: list[int]) -> Any:
    """A byte progress bar on a terminal (stderr); silent when not a terminal."""
    from tqdm import tqdm

    if not sys.stderr.isatty():  # no bar to size: the manifest is not read a second time for it
        return tqdm(total=0, disable=True)
    total = 0
    for step in steps:
        try:
            total += read_manifest(storage, step).owned_bytes
        except (DistCkptError, OSError):
            pass
    return tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not sys.stderr.isatty(),
                file=sys.stderr)


def cmd_prune(storage: Storage, args: argparse.Namespace) -> int:
    index = CommitIndex(storage)
    index.scan()
    leases = read_leases(storage)
    zombies = index.superseded(leases)  # loaded only as the last resort: counted toward nothing
    steps = [s for s in index.listing.committed() if s not in zombies]
    committed = read_committed(storage, steps, index)
    damaged = _damaged_among_kept(storage, committed, args, leases)
    counted = [c for c in committed if c.step not in damaged]
    doomed = sorted(plan_retention(counted, args.keep_last, args.keep_best, args.best_mode)
                    + superseded_to_retire(zombies, [c.step for c in counted]))
    keep = kept_references(committed, doomed)  # files the remaining checkpoints reference stay
    for step in doomed:
        if not args.dry_run:
            delete_checkpoint(storage, step, keep)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} step {s}" for s in doomed] or ["nothing to remove"]
    lines += [f"left damaged step {s} in place, counted toward nothing: {problems[0]}" for s, problems in damaged.items()]
    _emit(args, {"dry_run": args.dry_run, "removed": doomed, "damaged": {str(s): p for s, p in damaged.items()}},
          "\n".join(lines))
    return EXIT_OK


def _damaged_among_kept(storage: Storage, committed: list[Any], args: argparse.Namespace,
                        leases: list[Any]) -> dict[int, list[str]]:
    """The committed steps that do not verify, found among those the policy would keep: a step
    that cannot load must not count toward keep_last (a damaged newest step kept and every
    loadable one removed left nothing to resume from). Each kept step is verified once (read
    whole); a damaged one is left in place, and the next step down takes its place."""
    damaged: dict[int, list[str]] = {}
    verified: set[int] = set()
    while True:
        counted = [c for c in committed if c.step not in damaged]
        doomed = set(plan_retention(counted, args.keep_last, args.keep_best, args.best_mode))
        unverified = [c.step for c in counted if c.step not in doomed and c.step not in verified]
        if not unverified:
            return damaged
        for step in unverified:
            problems = verify_step(storage, step, leases=leases)
            if problems:
                damaged[step] = problems
            else:
                verified.add(step)


def cmd_gc(storage: Storage, args: argparse.Namespace) -> int:
    uploads: list[str] = []
    if args.dry_run:  # the same decisions as the real collection
        doomed = [mf.parse_step_dir(n) for n in collect_leftovers(storage, args.grace_s, dry_run=True, uploads=uploads)]
        lines = [f"would remove uncommitted step {s}" for s in doomed]
        lines += [f"would abort the abandoned upload of {key}" for key in uploads]
        _emit(args, {"dry_run": True, "removed": doomed, "aborted_uploads": uploads},
              "\n".join(lines) or "nothing to collect")
        return EXIT_OK
    removed = collect_leftovers(storage, args.grace_s, uploads=uploads)
    lines = [f"removed uncommitted {n}" for n in removed] + [f"aborted the abandoned upload of {key}" for key in uploads]
    _emit(args, {"dry_run": False, "removed": [mf.parse_step_dir(n) for n in removed], "aborted_uploads": uploads},
          "\n".join(lines) or "nothing to collect")
    return EXIT_OK


def cmd_diff(storage: Storage, args: argparse.Namespace) -> int:
    committed = list_committed(storage)
    absent = [step for step in (args.a, args.b) if step not in committed]
    if absent:  # said as such, not as a missing COMMITTED file
        return _fail(args, f"step {absent[0]} is not committed at {storage.url} (committed: {committed[:10]})",
                     EXIT_USAGE)
    rows = diff_steps(storage, args.a, args.b)
    lines = []
    for r in rows:
        if r["change"] == "values":
            lines.append(f"{r['key']}: {r['changed_elements']} elements changed, max |diff| {r['max_abs_diff']:.6g}")
        elif r["change"] == "value":
            lines.append(f"{r['key']}: {_value_change(r['old'], r['new'])}")
        elif "old" in r:  # a change of type or of bits alone: the values too
            lines.append(f"{r['key']}: {r['change']} ({_brief(r['old'])} -> {_brief(r['new'])})")
        else:
            lines.append(f"{r['key']}: {r['change']}")
    _emit(args, rows, "\n".join(lines) or f"steps {args.a} and {args.b} hold the same state")
    return EXIT_OK


_BRIEF_CHARS = 80


def _brief(value: Any) -> str:
    """A value for the text form of `diff`: whole when short; a long list or tuple (an RNG state's
    624-word key) as its first items and length. --json holds every value whole."""
    text = repr(value)
    if len(text) <= _BRIEF_CHARS:
        return text
    if isinstance(value, (list, tuple)):
        shown = []
        for item in value:
            shown.append(repr(item))
            if sum(len(x) + 2 for x in shown) > _BRIEF_CHARS // 2:
                break
        return f"{type(value).__name__} of {len(value)} items [{', '.join(shown)}, ...]"
    return text[:_BRIEF_CHARS - 3] + "..."


def _value_change(old: Any, new: Any) -> str:
    """Two lists of one length (an RNG state) by what differs in them; other values briefly."""
    if isinstance(old, (list, tuple)) and type(old) is type(new) and len(old) == len(new) \
            and len(repr(old)) > _BRIEF_CHARS:
        differ = [i for i, (a, b) in enumerate(zip(old, new)) if repr(a) != repr(b)]
        if differ:
            i = differ[0]
            return (f"{type(old).__name__} of {len(old)} items, {len(differ)} differ (first at [{i}]: "
                    f"{_brief(old[i])} -> {_brief(new[i])})")
    return f"{_brief(old)} -> {_brief(new)}"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one JSON document too when --json was asked for."""

    def error(self, message: str) -> NoReturn:
        argv = _ARGV or sys.argv[1:]
        own = argv[:argv.index("--")] if "--" in argv else argv  # doctor: what follows -- is the user's
        if "--json" in own:
            named = next((a for a in own if a in COMMANDS or a == "doctor"), None)
            print(json.dumps({"command": named, "error": f"usage: {message}", "exit_code": EXIT_USAGE}))
            raise SystemExit(EXIT_USAGE)
        super().error(message)


_ARGV: list[str] = []


def cmd_export(storage: Storage, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from distckpt.tools.weights import export_weights, open_checkpoint_model

    source = open_checkpoint_model(args.url, step=args.step, entry=args.entry)
    total = sum(_nbytes(d, s) for d, s in source.spec.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not sys.stderr.isatty(),
              file=sys.stderr) as bar:
        summary = export_weights(args.url, args.out_dir, step=source.step, entry=args.entry, dtype=args.dtype,
                                 max_shard_size=args.max_shard_size, progress=bar.update)
    text = (f"exported step {summary.step}: {summary.tensors} tensors, {summary.total_size:,} bytes into "
            f"{summary.out_dir} ({', '.join(summary.files)}); every tensor read back and verified")
    _emit(args, vars(summary), text)
    return EXIT_OK


def cmd_import(storage: Storage, args: argparse.Namespace) -> int:
    from distckpt.tools.importing import import_dcp, import_torch

    run = import_torch if args.command == "import-torch" else import_dcp
    step = run(args.source, args.url, trust_pickle=args.trust_pickle, world_size=args.world_size, step=args.step)
    _emit(args, {"url": args.url, "step": step, "world_size": args.world_size},
          f"imported {args.source} into {args.url} as committed step {step} (world size {args.world_size})")
    return EXIT_OK


def _nbytes(dtype: Any, shape: list[int]) -> int:
    import math as _math

    import torch

    return _math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _step(text: str) -> int:
    """A step number: an int >= 0 (steps are never negative), in ASCII digits only (int() also took
    " 2", "2_0" and "٢")."""
    try:
        if not re.fullmatch(r"[0-9]+", text):
            raise ValueError(text)
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (an int >= 0)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a step number: steps are >= 0")
    return value


def _seconds(text: str) -> float:
    """A duration: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="distckpt", description=__doc__.splitlines()[0],
                epilog="exit codes: 0 ok, 1 problem found, 2 usage, missing root or storage error")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_text)
        s.error = p.error  # type: ignore[method-assign]  # the JSON-aware one
        s.add_argument("url", help="checkpoint root: a local path or fsspec URL (s3://bucket/prefix)")
        s.add_argument("--json", action="store_true", help="machine-readable output")
        return s

    tiered = []
    tiered.append(command("ls", "committed checkpoints and uncommitted leftovers"))
    inspect = command("inspect", "one checkpoint in detail")
    inspect.add_argument("--step", type=_step)
    verify = command("verify", "check sizes, checksums and structure")
    tiered += [inspect, verify]
    for tiered_command in tiered:
        tiered_command.add_argument("--local-dir", help="a two-tier job's local_dir: show that tier too")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step)
    which.add_argument("--all", action="store_true")
    prune = command("prune", "apply a retention policy")
    prune.add_argument("--keep-last", type=int, required=True)
    prune.add_argument("--keep-best", type=int)
    prune.add_argument("--best-mode", choices=("min", "max"), default="min")
    prune.add_argument("--dry-run", action="store_true")
    gc = command("gc", "remove uncommitted leftovers and abandoned uploads")
    gc.add_argument("--grace-s", type=_seconds, default=3600.0,
                    help="only collect leftovers older than this (a save may be in progress)")
    gc.add_argument("--dry-run", action="store_true")
    export = command("export", "the model entry as Hugging Face safetensors (shards + index when large)")
    export.add_argument("out_dir")
    export.add_argument("--step", type=_step)
    export.add_argument("--entry", default="model", help="the key of the model in `state` (default: model)")
    export.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating-point tensors")
    export.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (Hugging Face's convention)")
    for name, what in (("import-torch", "a torch.save file"), ("import-dcp", "a torch.distributed.checkpoint directory")):
        imp = sub.add_parser(name, help=f"{what} in, as a committed checkpoint")
        imp.error = p.error  # type: ignore[method-assign]
        imp.add_argument("source", help=what)
        imp.add_argument("url", help="the new checkpoint root")
        imp.add_argument("--trust-pickle", action="store_true", help="required: the source is a pickle")
        imp.add_argument("--world-size", type=int, default=1, help="ranks of the job that will resume from it")
        imp.add_argument("--step", type=_step, help="the step to commit it as (default: its 'step', else 0)")
        imp.add_argument("--json", action="store_true")
    diff = command("diff", "what changed between two steps")
    diff.add_argument("a", type=_step)
    diff.add_argument("b", type=_step)
    # listed for --help only: main() hands `doctor` to doctor_main before this parser runs
    sub.add_parser("doctor", help="does the job resume bit for bit? runs it twice, kills one, compares "
                   "(distckpt doctor --help)", add_help=False)
    return p


COMMANDS = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "prune": cmd_prune,
            "gc": cmd_gc, "diff": cmd_diff, "export": cmd_export, "import-torch": cmd_import,
            "import-dcp": cmd_import}


_TAKES_A_VALUE = ("--max-shard-size", "--step", "--keep-last", "--keep-best")


def _joined_values(argv: list[str]) -> list[str]:
    """`--max-shard-size -1GB` as `--max-shard-size=-1GB`: argparse takes a value starting with '-'
    (that is not a plain negative number) for an option and said only "expected one argument";
    joined, the option's own check says what is wrong with the value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _TAKES_A_VALUE and arg.startswith("-") and arg != "--":
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["doctor"]:  # its own parser: everything after -- is the user's command
        with collector_paused():  # its own process compares whole states (gcpause.py)
            return doctor_main(raw[1:])
    _ARGV[:] = list(argv or [])
    args = build_parser().parse_args(_joined_values(raw))
    if getattr(args, "keep_last", 1) is not None and getattr(args, "keep_last", 1) < 1:
        return _fail(args, "--keep-last must be >= 1", EXIT_USAGE)
    if getattr(args, "keep_best", None) is not None and args.keep_best < 1:
        return _fail(args, "--keep-best must be >= 1 (leave it out to keep no best steps beyond --keep-last)", EXIT_USAGE)
    try:
        storage = open_storage(args.url)
        mf.refuse_step_directory(args.url)
        if not args.command.startswith("import") and not _root_exists(storage, args.url):
            local = getattr(storage, "root", None)
            if isinstance(local, str) and os.path.exists(local):
                return _fail(args, f"{args.url}: is a file, not a checkpoint root (a directory a CheckpointManager "
                             "saved into)", EXIT_USAGE)
            return _fail(args, f"{args.url}: no such checkpoint root (nothing is stored there)", EXIT_USAGE)
        with collector_paused():  # one command's trees, as in a save or load (gcpause.py)
            code = COMMANDS[args.command](storage, args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return code
    except BrokenPipeError:
        _quiet_stdout()  # `distckpt ls URL | head`: the reader left; not an error
        return EXIT_OK
    except (DistCkptError, OSError) as e:
        return _fail(args, str(e), EXIT_USAGE)


def doctor_main(argv: list[str]) -> int:
    """`distckpt doctor`: its own parser, since everything after -- is the user's command."""
    from distckpt.tools.doctor import report_json, report_text, run_doctor

    _ARGV[:] = ["doctor", *argv]
    p = _Parser(prog="distckpt doctor", description="does the job resume bit for bit? names what breaks it")
    p.add_argument("--kill-at", type=int, help="SIGKILL a rank right after the commit of this step (default: the first)")
    p.add_argument("--steps", type=int, help="end both runs after the commit of this step (the manager exits the job)")
    p.add_argument("--kill-rank", type=int, help="which rank (default: the last)")
    p.add_argument("--every", type=int, help="also fingerprint the parameters every K optimizer steps, to find "
                   "the first differing step between checkpoints")
    p.add_argument("--workdir", help="where the two runs' roots go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds each run may take before it counts as hung and is killed (default 3600)")
    p.add_argument("--json", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command, as you run it")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the launch command after --")
    for name, lowest in (("every", 1), ("steps", 1), ("kill_at", 0), ("kill_rank", 0)):
        if getattr(args, name) is not None and getattr(args, name) < lowest:
            p.error(f"--{name.replace('_', '-')} must be >= {lowest}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error("--timeout must be a positive number of seconds")
    start = time.monotonic()
    try:
        report = run_doctor(command, args.kill_at, args.kill_rank, args.workdir, timeout=args.timeout,
                            steps=args.steps, every=args.every,
                            announce=lambda line: print(f"distckpt doctor: {line}", file=sys.stderr, flush=True))
    except (DistCkptError, OSError, subprocess.TimeoutExpired) as e:
        args.command = "doctor"  # _fail names the command (args.command held the user's)
        message = str(e)
        if len(message) > 4000:  # the header (which run, how it ended, what it raised) stays
            head, _, rest = message.partition("its last output:")
            message = head[:1500] + "its last output (its end):\n..." + rest[-2500:]
        return _fail(args, message, EXIT_USAGE)
    print(report_json(report) if args.json else report_text(report) + f"\n({time.monotonic() - start:.0f} s)")
    if report.identical:
        return EXIT_OK
    # 1 means "they differ" (a checkpoint, or the parameters' fingerprints); a check that compared
    # nothing after the kill (the kill step never reached, no common step after it) proved nothing
    return EXIT_PROBLEM if report.differs else EXIT_USAGE


def _root_exists(storage: Storage, url: str) -> bool:
    local = getattr(storage, "root", None)
    if "://" not in url or url.startswith("file://"):
        return os.path.isdir(local) if isinstance(local, str) else True
    return bool(storage.list_dir(""))  # an object store has no empty directories


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())

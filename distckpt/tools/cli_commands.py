"""The commands of the `distckpt` command line: cli.py parses the arguments (and imports nothing
heavy); run_command runs one, here, with storage, the loader's rules and torch.

Text is for people (cli_text.py shapes it); --json documents are what scripts read, and keep
their shape. Progress bars go to stderr on a terminal, never with --json.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import sys
import time
from typing import Any, Callable, Iterator

from distckpt.errors import ConfigError, CorruptCheckpointError, DistCkptError, StorageError, SupersededCheckpointError
from distckpt.io import manifest as mf
from distckpt.io import signing
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
from distckpt.tools import cli_text
from distckpt.tools.cli import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, emit, fail
from distckpt.tools.inspection import (
    StepListing,
    describe_step,
    diff_steps,
    list_steps,
    marker_may_stand,
    read_manifest,
    verify_step,
)
from distckpt.tools.signing_tools import sign_step, use_verify_key


def run_command(args: argparse.Namespace) -> int:
    """One parsed command (not doctor): its exit code; an error of storage or of the checkpoint is
    said as one line (one JSON document with --json) with exit code 2."""
    try:
        storage = open_storage(args.url)
        mf.refuse_step_directory(args.url)
        if not args.command.startswith("import") and not _root_exists(storage, args.url):
            local = getattr(storage, "root", None)
            if isinstance(local, str) and os.path.exists(local):
                return fail(args, f"{args.url}: is a file, not a checkpoint root (a directory a CheckpointManager "
                            "saved into)", EXIT_USAGE)
            return fail(args, f"{args.url}: no such checkpoint root (nothing is stored there)", EXIT_USAGE)
        if args.command in ("ls", "verify", "export"):
            use_verify_key([storage], args.key)  # the local tier's storage too: _tiers
        with collector_paused():  # one command's trees, as in a save or load (gcpause.py)
            code = COMMANDS[args.command](storage, args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return code
    except BrokenPipeError:
        _quiet_stdout()  # `distckpt ls URL | head`: the reader left; not an error
        return EXIT_OK
    except (DistCkptError, OSError) as e:
        return fail(args, str(e), EXIT_USAGE)


def progress_bar(args: argparse.Namespace, total: int, desc: str, unit: str = "B") -> Any:
    """A tqdm bar on stderr when it is a terminal and the output is for people; else a silent one."""
    from tqdm import tqdm

    shown = sys.stderr.isatty() and not getattr(args, "json", False)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=not shown, file=sys.stderr,
                leave=False, dynamic_ncols=True)


def _shows_progress(args: argparse.Namespace) -> bool:
    return sys.stderr.isatty() and not getattr(args, "json", False)


def _tiers(storage: Storage, args: argparse.Namespace) -> list[tuple[str, Storage]]:
    """The roots a command reads: the URL, and with --local-dir the local tier too (a manager's
    local_dir=; the same rules, the same layout)."""
    tiers = [("durable", storage)]
    if getattr(args, "local_dir", None):
        if not os.path.isdir(args.local_dir):
            raise ConfigError(f"--local-dir {args.local_dir}: no such directory (the job's local_dir on this node)")
        local = open_storage(args.local_dir)
        signing.attach(local, signing.trust_of(storage))  # a verify key checks both tiers alike
        tiers.append(("local", local))
    return tiers


# ls


def cmd_ls(storage: Storage, args: argparse.Namespace) -> int:
    tiers = _tiers(storage, args)
    listed = [(tier, root, s) for tier, root in tiers for s in list_steps(root)]
    verdicts = _verify_listed(storage, listed, args) if args.verify else {}
    rows = []
    for tier, _, s in listed:
        m = s.manifest
        row = {"step": s.step, "status": s.status, "epoch": m and m.epoch, "metric": m and m.metric,
               "world_size": m and m.world_size, "created_unix": m and m.created_unix,
               "bytes": m and m.owned_bytes,
               # incremental: bytes of older steps' files it references (stored once, there)
               "shared_bytes": m and m.shared_bytes}
        if args.verify:  # --verify's rows say what reading every byte found (a key of its own)
            row.update(_verdict(s, verdicts.get((tier, s.step))))
        rows.append({**row, "tier": tier} if len(tiers) > 1 else row)
    if len(tiers) > 1:
        rows.sort(key=lambda r: (r["step"], r["tier"] == "local"))
    _emit_ls(storage, args, rows, len(tiers) > 1)
    return EXIT_PROBLEM if any(r.get("verified") is False for r in rows) else EXIT_OK


def _verify_listed(storage: Storage, listed: list[tuple[str, Storage, StepListing]],
                   args: argparse.Namespace) -> dict[tuple[str, int], list[str]]:
    """Each committed (or superseded) step read whole and checked, as `verify` does: its problems,
    by (tier, step). The durable root's (`storage`) leases judge both tiers (tiers.py)."""
    todo = [(tier, root, s) for tier, root, s in listed if s.status == "committed" or s.status.startswith("superseded")]
    total = sum(s.manifest.owned_bytes for _, _, s in todo if s.manifest is not None)
    leases = read_leases(storage)
    verdicts = {}
    with progress_bar(args, total, "verify") as bar:
        for tier, root, s in todo:
            superseded: list[str] = []  # a superseded writer's step: damaged only if its files are
            problems = verify_step(root, s.step, bar.update, leases, superseded)
            if problems and not marker_may_stand(root, s.step):
                problems = [_REMOVED]  # a running writer's retention took it while it was read: not damage
            verdicts[(tier, s.step)] = problems
    return verdicts


_REMOVED = "removed while it was verified (a running writer's retention)"


def _verdict(listing: StepListing, problems: list[str] | None) -> dict[str, Any]:
    if listing.status.startswith("damaged"):
        return {"verified": False, "problems": [listing.status.removeprefix("damaged: ")]}
    if problems == [_REMOVED]:
        return {"verified": None, "status": _REMOVED}
    if problems is None:  # uncommitted, retired: nothing to verify
        return {"verified": None}
    if problems:
        return {"verified": False, "status": f"damaged: {problems[0]}", "problems": problems}
    return {"verified": True}


def _status_text(row: dict[str, Any], verify: bool) -> str:
    """The status column: whether the payload was read and checked, not only the marker seen."""
    status = str(row["status"])
    if not (status == "committed" or status.startswith("superseded")):
        return status
    if not verify:
        return "committed (unverified)" if status == "committed" else status
    return "committed, verified" if status == "committed" else f"{status} (files verified)"


def _emit_ls(storage: Storage, args: argparse.Namespace, rows: list[dict[str, Any]], tiered: bool) -> None:
    shared = any(r.get("shared_bytes") for r in rows)  # incremental: a column of what steps reference
    lines = [f"{'step':>10} {'epoch':>6} {'world':>5} {'bytes':>12} " + (f"{'shared':>12} " if shared else "")
             + f"{'metric':>12} {'created':>20}  status" + ("  tier" if tiered else "")]
    for r in rows:
        stamp = r["created_unix"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if isinstance(stamp, (int, float)) else ""
        lines.append(f"{r['step']:>10} {_s(r['epoch']):>6} {_s(r['world_size']):>5} {_s(r['bytes']):>12} "
                     + (f"{_s(r['shared_bytes']):>12} " if shared else "")
                     + f"{_metric(r['metric']):>12} {created:>20}  {_status_text(r, args.verify)}"
                     + (f"  {r['tier']}" if "tier" in r else ""))
    if rows and not args.verify and any(str(r["status"]) == "committed" for r in rows):
        lines.append("(unverified: the commit marker was read, not the payload; `ls --verify` reads every byte)")
    if not any(str(r["status"]).startswith(("committed", "superseded")) for r in rows):
        resumed = resumed_leases(read_leases(storage))
        record = None if resumed else newest_commit_record(storage)
        if resumed:  # what load_latest raises about: the run's history is gone
            lines.append(f"no committed step, but {resumed[-1].describe()} had resumed from one: this run's "
                         "checkpoints are gone, and load_latest refuses to start it over silently")
        elif record is not None:
            lines.append(f"no committed step, but generation {record['generation']} committed one here: this run's "
                         "checkpoints are gone, and load_latest refuses to start it over silently")
    emit(args, rows, "\n".join(lines))


def _s(value: Any) -> str:
    return "" if value is None else str(value)


def _metric(value: Any) -> str:
    """A metric in its column: 0.03333333333333333 pushed every column after it out of line."""
    return f"{value:.6g}" if isinstance(value, float) else _s(value)


# the step a command looks at


def _steps(storage: Storage, args: argparse.Namespace) -> list[int]:
    every = getattr(args, "all", False) or (args.command == "verify" and args.step is None
                                              and signing.verifies(storage))  # --key: every step, as a signer vouches
    if every:  # as `ls` lists them: a damaged or unreadable step included
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


def _refuse_an_uncommitted_step(storage: Storage, args: argparse.Namespace) -> int | None:
    """--step N that no tier has committed (pruned, never saved) is said as such, as diff and export
    say it, not as a missing COMMITTED file (verify called it BAD)."""
    if args.step is None or any(args.step in list_committed(root) for _, root in _tiers(storage, args)):
        return None
    if marker_may_stand(storage, args.step):
        return None  # a marker no listing shows (a directory stands there): verify and inspect say what is wrong
    committed = list_committed(storage)
    return fail(args, f"step {args.step} is not committed at {storage.url} (committed: {committed[:10]})", EXIT_USAGE)


# inspect

_INSPECT_TRIES = 8  # steps per tier inspect tries before it gives up (each unreadable one is said)


def cmd_inspect(storage: Storage, args: argparse.Namespace) -> int:
    refused = _refuse_an_uncommitted_step(storage, args)
    if refused is not None:
        return refused
    found = _inspect_candidates(storage, args)
    if not found:
        return fail(args, f"no committed checkpoint at {storage.url}", EXIT_PROBLEM)
    passed_over: list[dict[str, Any]] = []
    for index, (_, step, tier, root) in enumerate(found):
        try:
            d = describe_step(root, step, rank_tensors=not args.json)
            break
        except (CorruptCheckpointError, StorageError) as e:
            # Without --step, the newest step it can read, as load_latest, export and load_weights
            # fall back (the files it describes are checked against the manifest's checksums as a
            # load checks them; `verify` checks every file of every step).
            if type(e) is StorageError and e.errno != errno.ELOOP:
                raise  # the storage failed, not the step: said as such (exit 2)
            passed_over.append({"step": step, "tier": tier, "url": root.url, "error": str(e)})
            if args.step is not None or index == len(found) - 1:  # nothing left to describe
                return fail(args, "\n".join(_damaged_lines(passed_over)), EXIT_PROBLEM)
            print(f"distckpt inspect: step {step} at {root.url} is damaged ({e}); describing the previous one",
                  file=sys.stderr)
    tier = found[index][2]
    if getattr(args, "local_dir", None):
        d["tier"] = tier
    if passed_over:  # the newest step is damaged: said, and the exit code says it too
        d["passed_over"] = passed_over
    emit(args, d, "\n".join(_inspect_text(d, args, tier, passed_over)))
    return EXIT_PROBLEM if passed_over else EXIT_OK


def _inspect_candidates(storage: Storage, args: argparse.Namespace) -> list[tuple[bool, int, str, Storage]]:
    """(superseded, step, tier, root) to describe, the one wanted first: --step's, or the newest
    as load_latest tries them (the local copy first), a superseded writer's last."""
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
    found.sort(key=lambda f: (not f[0], f[1], f[2] == "local"), reverse=True)
    return found


def _damaged_lines(passed_over: list[dict[str, Any]]) -> list[str]:
    return [f"damaged: step {p['step']} at {p['url']}: {p['error']}" for p in passed_over]


def _inspect_text(d: dict[str, Any], args: argparse.Namespace, tier: str, passed_over: list[dict[str, Any]]) -> list[str]:
    m = d["manifest"]
    lines = _damaged_lines(passed_over)
    lines += [f"step {m['step']}  epoch {m['epoch']}  metric {m['metric']}  world size {m['world_size']}  run {m['run_id']}"
              + (f"  ({tier} tier)" if getattr(args, "local_dir", None) else "")
              + ("  (an older step: the newer ones above are damaged)" if passed_over else ""),
              "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
              f"config: {json.dumps(d['config'])}", "ranks:"]
    for r, info in zip(d["ranks"], m["ranks"]):
        lines.append(f"  rank {r['rank']} on {info['host']}: epoch {r['epoch']}, RNG streams {r['rng_streams']}")
        lines += [f"    {k}: {json.dumps(v, default=str)}" for k, v in r["entries"].items()]
    entries = cli_text.group_entries(d)
    lines.append(f"entries ({len(m['entries'])}):")
    lines += cli_text.entries_table(entries, m["world_size"])
    lines.append(f"bytes: {d['bytes_owned']:,} in this step's files"
                 + (f", {d['bytes_shared']:,} in files of older steps it references (incremental)"
                    if d["bytes_shared"] else ""))
    if args.tensors:
        lines.append("tensors:")
        lines += cli_text.tensor_lines(d)
    else:
        lines.append("(every tensor with its shape: --tensors)")
    return lines


# verify

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
            return fail(args, f"no committed checkpoint at {storage.url}", EXIT_PROBLEM)
        with progress_bar(args, _bytes_of(todo) if _shows_progress(args) else 0, "verify") as bar:
            for tier, root, step in todo:
                # A superseded writer's step named with --step is refused, as load(state, step) refuses
                # it; listed (plain, --all) it is the loader's last resort, damaged only if its files are.
                superseded: list[str] | None = [] if args.step is None else None
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
        return fail(args, f"every committed step at {storage.url} was removed while it was verified (a running "
                    "writer's retention); run it again", EXIT_PROBLEM)
    label = (lambda r: f"step {r['step']} ({r['tier']})") if len(tiers) > 1 else (lambda r: f"step {r['step']}")
    lines = [f"{label(r)}: ok" + (f" (superseded, loaded only as the last resort: {r['superseded']})" if r["superseded"] else "")
             if r["ok"] else f"{label(r)}: BAD\n" + "\n".join(f"  {x}" for x in r["problems"])
             for r in rows]
    bad = [r for r in rows if not r["ok"]]
    # A damaged lease breaks no step, but it fences every older writer: say so, with what follows.
    lines += [f"damaged lease: {lease.describe()}; it counts as an incarnation that resumed from nothing, "
              "so no older generation's step is loaded but as the last resort" for lease in leases if lease.damaged]
    if bad and signing.verifies(storage):  # the first bad step and why, last, where a script's log ends
        lines.append(f"first bad step: {label(bad[0])}: {bad[0]['problems'][0]}")
    emit(args, rows, "\n".join(lines))
    return EXIT_PROBLEM if bad else EXIT_OK


def _bytes_of(todo: list[tuple[str, Storage, int]]) -> int:
    """The bytes a progress bar counts toward: each step's own files (the manifest read once more)."""
    total = 0
    for _, root, step in todo:
        try:
            total += read_manifest(root, step).owned_bytes
        except (DistCkptError, OSError):
            pass  # unreadable: verify says so
    return total


# prune, gc


def cmd_prune(storage: Storage, args: argparse.Namespace) -> int:
    index = CommitIndex(storage)
    index.scan()
    leases = read_leases(storage)
    zombies = index.superseded(leases)  # loaded only as the last resort: counted toward nothing
    steps = [s for s in index.listing.committed() if s not in zombies]
    committed = read_committed(storage, steps, index)
    damaged = _damaged_among_kept(storage, committed, args, leases)
    counted = [c for c in committed if c.step not in damaged]
    damaged.update(_markers_not_files(storage, index.listing))
    doomed = sorted(plan_retention(counted, args.keep_last, args.keep_best, args.best_mode)
                    + superseded_to_retire(zombies, [c.step for c in counted]))
    keep = kept_references(committed, doomed)  # files the remaining checkpoints reference stay
    if not args.dry_run:
        with progress_bar(args, len(doomed), "prune", unit="step") as bar:
            for step in doomed:
                delete_checkpoint(storage, step, keep)
                bar.update(1)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} step {s}" for s in doomed] or ["nothing to remove"]
    lines += [f"left damaged step {s} in place, counted toward nothing: {problems[0]}" for s, problems in damaged.items()]
    emit(args, {"dry_run": args.dry_run, "removed": doomed, "damaged": {str(s): p for s, p in damaged.items()}},
         "\n".join(lines))
    return EXIT_OK


def _markers_not_files(storage: Storage, listing: Any) -> dict[int, list[str]]:
    """Steps whose COMMITTED stands as something other than a file (a directory, a fifo): the
    listing holds files only, so such a step looks never committed, yet ls, verify and the
    loader call it damaged; prune says so too and leaves it in place (it removes none of these:
    only committed steps are pruned). One existence check per uncommitted step directory."""
    committed = set(listing.committed())
    out: dict[int, list[str]] = {}
    for name in listing.step_names():
        step = mf.parse_step_dir(name)
        if step is not None and step not in committed and storage.exists(f"{name}/{mf.MARKER}"):
            out[step] = [f"{name}/{mf.MARKER} is not a file (something else stands there): the step cannot load"]
    return out


def _damaged_among_kept(storage: Storage, committed: list[Any], args: argparse.Namespace,
                        leases: list[Any]) -> dict[int, list[str]]:
    """The committed steps that do not verify, found among those the policy would keep: a step
    that cannot load must not count toward keep_last (a damaged newest step kept and every
    loadable one removed left nothing to resume from). Each kept step is verified once (read
    whole); a damaged one is left in place, and the next step down takes its place."""
    damaged: dict[int, list[str]] = {}
    verified: set[int] = set()
    with progress_bar(args, 0, "verify kept steps") as bar:
        while True:
            counted = [c for c in committed if c.step not in damaged]
            doomed = set(plan_retention(counted, args.keep_last, args.keep_best, args.best_mode))
            unverified = [c.step for c in counted if c.step not in doomed and c.step not in verified]
            if not unverified:
                return damaged
            bar.total = (bar.total or 0) + (_bytes_of([("", storage, s) for s in unverified])
                                            if _shows_progress(args) else 0)
            for step in unverified:
                problems = verify_step(storage, step, bar.update, leases=leases)
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
        emit(args, {"dry_run": True, "removed": doomed, "aborted_uploads": uploads},
             "\n".join(lines) or "nothing to collect")
        return EXIT_OK
    # on a terminal, the bar's length from a dry run first (the same decisions, nothing removed)
    total = len(collect_leftovers(storage, args.grace_s, dry_run=True)) if _shows_progress(args) else 0
    with progress_bar(args, total, "gc", unit="step") as bar:
        removed = collect_leftovers(storage, args.grace_s, uploads=uploads, progress=lambda name: bar.update(1))
    lines = [f"removed uncommitted {n}" for n in removed] + [f"aborted the abandoned upload of {key}" for key in uploads]
    emit(args, {"dry_run": False, "removed": [mf.parse_step_dir(n) for n in removed], "aborted_uploads": uploads},
         "\n".join(lines) or "nothing to collect")
    return EXIT_OK


# diff


def cmd_diff(storage: Storage, args: argparse.Namespace) -> int:
    committed = list_committed(storage)
    absent = [step for step in (args.a, args.b) if step not in committed]
    if absent:  # said as such, not as a missing COMMITTED file
        return fail(args, f"step {absent[0]} is not committed at {storage.url} (committed: {committed[:10]})",
                    EXIT_USAGE)
    rows = diff_steps(storage, args.a, args.b)
    if args.json:
        emit(args, rows, "")
        return EXIT_OK
    before, after = (list(read_manifest(storage, step).entries) for step in (args.a, args.b))
    keys = sorted(set(before) | set(after))
    lines = cli_text.summary_lines(args.a, args.b, cli_text.summarize_diff(rows, before, after), rows, keys)
    if rows:
        lines.append("details:")
    for r in rows:
        if r["change"] == "values":
            lines.append(f"{r['key']}: {r['changed_elements']} elements changed, max |diff| {r['max_abs_diff']:.6g}")
        elif r["change"] == "value":
            lines.append(f"{r['key']}: {_value_change(r['old'], r['new'])}")
        elif "old" in r:  # a change of type or of bits alone: the values too
            lines.append(f"{r['key']}: {r['change']} ({_brief(r['old'])} -> {_brief(r['new'])})")
        else:
            lines.append(f"{r['key']}: {r['change']}")
    if not rows:
        lines.append(f"steps {args.a} and {args.b} hold the same state")
    emit(args, rows, "\n".join(lines))
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


# export, import


def cmd_sign(storage: Storage, args: argparse.Namespace) -> int:
    done = sign_step(storage, args.step, args.key)
    emit(args, done, f"signed step {done['step']}: {done['files']} files' BLAKE3 digests, key {done['key']}")
    return EXIT_OK


def cmd_export(storage: Storage, args: argparse.Namespace) -> int:
    from distckpt.io import model_signature
    from distckpt.tools.weights import export_weights, open_checkpoint_model

    if args.signature is not None and args.sign is None:
        raise ConfigError("--signature: names where the signature of --sign KEY goes; give --sign too")
    if args.sign is not None:  # refused before the step is read, with the flag's name
        model_signature.load_key(args.sign, "--sign")
    source = open_checkpoint_model(args.url, step=args.step, entry=args.entry, verify_key=args.key)
    total = sum(_nbytes(d, s) for d, s in source.spec.values())
    with progress_bar(args, total, "export") as bar:
        summary = export_weights(args.url, args.out_dir, step=source.step, entry=args.entry, dtype=args.dtype,
                                 max_shard_size=args.max_shard_size, progress=bar.update, verify_key=args.key,
                                 sign_key=args.sign, signature=args.signature)
    text = (f"exported step {summary.step}: {summary.tensors} tensors, {summary.total_size:,} bytes into "
            f"{summary.out_dir} ({', '.join(summary.files)}); every tensor read back and verified")
    if summary.signature is not None:
        text += (f"; signed for OpenSSF model-signing into {summary.signature} (check it with `model_signing verify "
                 f"key {summary.out_dir} --signature {summary.signature} --public_key PUBKEY`)")
    emit(args, vars(summary), text)
    return EXIT_OK


def cmd_import(storage: Storage, args: argparse.Namespace) -> int:
    from distckpt.tools.importing import import_dcp, import_torch

    run = import_torch if args.command == "import-torch" else import_dcp
    phases = 3 if args.command == "import-torch" else 4
    with progress_bar(args, phases, "import", unit="phase") as bar:
        step = run(args.source, args.url, trust_pickle=args.trust_pickle, world_size=args.world_size, step=args.step,
                   progress=_phase_ticker(bar))
    emit(args, {"url": args.url, "step": step, "world_size": args.world_size},
         f"imported {args.source} into {args.url} as committed step {step} (world size {args.world_size})")
    return EXIT_OK


def _phase_ticker(bar: Any) -> Callable[[str], None]:
    """An importer's phases on the bar: each counted and named as it starts."""
    def started(phase: str) -> None:
        bar.set_postfix_str(phase, refresh=False)
        bar.update(1)
    return started


def _nbytes(dtype: Any, shape: list[int]) -> int:
    import math

    import torch

    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


COMMANDS: dict[str, Callable[[Storage, argparse.Namespace], int]] = {
    "ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "sign": cmd_sign, "prune": cmd_prune, "gc": cmd_gc,
    "diff": cmd_diff, "export": cmd_export, "import-torch": cmd_import, "import-dcp": cmd_import}


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

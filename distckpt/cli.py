"""The `distckpt` command line: read checkpoints with exactly the loader's rules.

    distckpt ls URL [--json]               committed checkpoints, and uncommitted leftovers
    distckpt inspect URL [--step N] [--json]   manifest, ranks, entries, tensor table
    distckpt verify URL [--step N | --all]     sizes and checksums; exit 1 on any problem

Exit codes: 0 success, 1 a problem was found (verify) or nothing committed (inspect),
2 bad usage or unreadable storage. S3 settings come from the standard AWS environment.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import manifest as mf
from .errors import CorruptCheckpointError, DistCkptError
from .protocol import list_committed
from .serialize import read_header
from .storage import Storage, open_storage


def _manifest(storage: Storage, step: int) -> dict[str, Any]:
    base = mf.step_dir(step)
    where = f"{storage.url}/{base}"
    marker = mf.Marker.parse(storage.read_bytes(f"{base}/{mf.MARKER}"), where)
    return mf.parse_manifest(storage.read_bytes(f"{base}/{mf.MANIFEST}"), marker, where)


def cmd_ls(storage: Storage, args: argparse.Namespace) -> int:
    committed = list_committed(storage)
    rows = []
    for step in sorted(committed):
        try:
            m = _manifest(storage, step)
            rows.append({"step": step, "epoch": m.get("epoch"), "metric": m.get("metric"),
                         "world_size": m.get("world_size"), "created_unix": m.get("created_unix"),
                         "bytes": sum(f["size"] for f in m["files"].values()), "status": "committed"})
        except (DistCkptError, OSError) as e:
            rows.append({"step": step, "status": f"damaged: {e}"})
    leftovers = [n for n in storage.list_dir("") if mf.parse_step_dir(n) is not None
                 and mf.parse_step_dir(n) not in committed]
    rows += [{"step": mf.parse_step_dir(n), "status": "uncommitted"} for n in leftovers]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'step':>10} {'epoch':>6} {'world':>5} {'bytes':>12} {'metric':>12}  status")
    for r in rows:
        print(f"{r['step']:>10} {str(r.get('epoch', '')):>6} {str(r.get('world_size', '')):>5} "
              f"{str(r.get('bytes', '')):>12} {str(r.get('metric', '')):>12}  {r['status']}")
    return 0


def _pick_steps(storage: Storage, args: argparse.Namespace) -> list[int]:
    committed = list_committed(storage)
    if getattr(args, "all", False):
        return committed
    if args.step is not None:
        return [args.step]
    return committed[:1]


def cmd_inspect(storage: Storage, args: argparse.Namespace) -> int:
    steps = _pick_steps(storage, args)
    if not steps:
        print(f"no committed checkpoint at {storage.url}", file=sys.stderr)
        return 1
    m = _manifest(storage, steps[0])
    header, _ = read_header(storage.read_bytes(f"{mf.step_dir(steps[0])}/{mf.REPLICATED_FILE}"), "replicated")
    tensors = [{"name": k, "dtype": v["dtype"], "shape": v["shape"],
                "bytes": v["data_offsets"][1] - v["data_offsets"][0]}
               for k, v in header.items() if k != "__metadata__"]
    if args.json:
        print(json.dumps({"manifest": m, "tensors": tensors}, indent=1))
        return 0
    print(f"step {m['step']} epoch {m['epoch']} metric {m['metric']} world size {m['world_size']} run {m['run_id']}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    for r in m["ranks"]:
        print(f"  rank {r['rank']}: host {r['host']} step {r['step']} epoch {r['epoch']} per-rank {r['per_rank_entries']}")
    print("entries: " + ", ".join(f"{k} ({v['kind']}, {v['scope']})" for k, v in m["entries"].items()))
    for t in tensors:
        print(f"  {t['name']:<50} {t['dtype']:>5} {str(t['shape']):>16} {t['bytes']:>12}")
    return 0


def cmd_verify(storage: Storage, args: argparse.Namespace) -> int:
    problems = 0
    for step in _pick_steps(storage, args):
        base = mf.step_dir(step)
        try:
            m = _manifest(storage, step)
            for name, record in m["files"].items():
                mf.verify_file(storage.read_bytes(f"{base}/{name}"), record, f"{storage.url}/{base}/{name}")
            print(f"step {step}: ok ({len(m['files'])} files)")
        except (CorruptCheckpointError, DistCkptError, OSError) as e:
            problems += 1
            print(f"step {step}: BAD: {e}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distckpt", description="Read distckpt checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("ls", "inspect", "verify"):
        s = sub.add_parser(name)
        s.add_argument("url")
        s.add_argument("--json", action="store_true")
        if name != "ls":
            s.add_argument("--step", type=int)
        if name == "verify":
            s.add_argument("--all", action="store_true")
    args = p.parse_args(argv)
    try:
        storage = open_storage(args.url)
        return {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify}[args.command](storage, args)
    except (DistCkptError, OSError) as e:
        print(f"distckpt {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

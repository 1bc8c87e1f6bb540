"""The `distckpt` command line: read and tidy checkpoints with exactly the loader's rules.

    distckpt ls URL [--verify] [--local-dir D] [--json]   committed steps (verified with --verify), leftovers
    distckpt inspect URL [--step N] [--tensors] [--local-dir D] [--json]   one step: manifest, ranks, config,
                      one line per entry (--tensors: every tensor, in natural order)
    distckpt verify URL [--step N | --all] [--local-dir D] [--json]   sizes, checksums, structure
                      (--local-dir: a two-tier job's local tier as well, each row saying which)
    distckpt prune URL --keep-last N [--keep-best K] [--best-mode min|max] [--dry-run]
    distckpt gc URL [--grace-s S] [--dry-run]         uncommitted leftovers, abandoned uploads
    distckpt diff URL A B [--json]                    what changed between steps A and B: a summary, then the details
    distckpt doctor [--kill-at N] [--steps M] [--every K] [--kill-rank R] [--resize M] [--timeout S] [--json] -- <launch command>
                                                      does the job resume bit for bit? names what breaks it
    distckpt import-torch FILE URL --trust-pickle [--world-size N] [--step S]   a torch.save file in
    distckpt import-dcp DCP_DIR URL --trust-pickle [--world-size N] [--step S]  a DCP checkpoint in
    distckpt export URL OUT_DIR [--step N] [--entry model] [--dtype bf16] [--max-shard-size 5GB]
                    [--sign KEY [--signature PATH]] [--json]
                                                      the model as Hugging Face safetensors, verified
                                                      (--sign: and signed for OpenSSF model-signing)

Exit codes: 0 success; 1 a problem was found (verify, ls --verify, a damaged newest step that
inspect passed over) or nothing to show; 2 bad usage (any value an option refuses), a root that
does not exist, or storage that cannot be read. With --json every outcome, errors included, is
one JSON document on stdout ({"error": ..., "exit_code": ...} for errors; non-finite floats as
the strings "nan", "inf", "-inf"). Progress bars go to stderr, on a terminal only, never with
--json. S3 credentials and endpoint come from the AWS_* environment.

This module imports nothing heavy: --help, a refused argument and the parser itself cost about a
bare interpreter's start. A command imports its implementation (cli_commands.py, and torch)
only once its arguments are accepted.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from typing import Any, NoReturn

from distckpt.errors import ConfigError, DistCkptError
from distckpt.tools.sizes import LARGEST_SIZE, parse_size

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

# The bound state/validation.py's check_step puts on a step (importing it would import torch).
LARGEST_COUNT = 2**63 - 1

# The subcommands this parser runs; `doctor` has a parser of its own (everything after -- is the user's).
COMMANDS = ("ls", "inspect", "verify", "sign", "prune", "gc", "diff", "export", "import-torch", "import-dcp")


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(json_safe(data), indent=1, default=str, allow_nan=False) if args.json else text)


def json_safe(value: Any) -> Any:
    """JSON has no NaN or Infinity: they become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def fail(args: argparse.Namespace, message: str, code: int) -> int:
    """An error: one JSON document on stdout with --json, a line on stderr without."""
    if getattr(args, "json", False):
        print(json.dumps({"command": getattr(args, "command", None), "error": message, "exit_code": code}))
    else:
        print(f"distckpt {getattr(args, 'command', '')}: {message}", file=sys.stderr)
    return code


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


# Argument types: each names what it expected; argparse adds the option ("argument --step: ...").


def _step(text: str) -> int:
    """A step number: an int from 0 to 2**63-1, in ASCII digits only (int() also took " 2", "2_0" and "٢")."""
    if not re.fullmatch(r"[0-9]+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (an int >= 0)")
    value = int(text)
    if value > LARGEST_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:40]}{'...' if len(text) > 40 else ''} is not a step number: "
                                         "steps are at most 2**63-1")
    return value


def _whole(text: str) -> int:
    """An int in ASCII digits, maybe negative (its own check says which are allowed), within +-(2**63-1)."""
    if not re.fullmatch(r"-?[0-9]+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    value = int(text)
    if abs(value) > LARGEST_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:40]}{'...' if len(text) > 40 else ''} is out of range "
                                         "(at most 2**63-1)")
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


def _size(text: str) -> str:
    """--max-shard-size, checked here (exit 2 before anything is read); handed on as written."""
    try:
        parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="distckpt", description=(__doc__ or "").splitlines()[0],
                epilog="exit codes: 0 ok, 1 problem found, 2 usage, missing root or storage error")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_text)  # a _Parser too: its usage, and JSON errors with --json
        s.add_argument("url", help="checkpoint root: a local path or fsspec URL (s3://bucket/prefix)")
        s.add_argument("--json", action="store_true", help="machine-readable output")
        return s

    ls = command("ls", "committed checkpoints and uncommitted leftovers")
    ls.add_argument("--verify", action="store_true",
                    help="read every committed step whole and check its checksums (as `verify` does); a damaged "
                         "one is listed as damaged, with the reason, and the exit code is 1")
    inspect = command("inspect", "one checkpoint: ranks, config, one line per entry")
    inspect.add_argument("--step", type=_step)
    inspect.add_argument("--tensors", action="store_true", help="also list every tensor (natural order), with "
                         "its shape, dtype and bytes")
    verify = command("verify", "check sizes, checksums and structure")
    for tiered_command in (ls, inspect, verify):
        tiered_command.add_argument("--local-dir", help="a two-tier job's local_dir: show that tier too")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step)
    which.add_argument("--all", action="store_true")
    sign = command("sign", "sign a committed step (after checking its checksums) with an Ed25519 private key")
    sign.add_argument("--key", required=True, help="the private key, a PEM file")
    sign.add_argument("--step", type=_step, required=True)
    prune = command("prune", "apply a retention policy")
    prune.add_argument("--keep-last", type=_whole, required=True)
    prune.add_argument("--keep-best", type=_whole)
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
    export.add_argument("--max-shard-size", type=_size, default="5GB",
                        help=f"e.g. 5GB, 500MB, 2GiB or a count of bytes, at most {LARGEST_SIZE} (Hugging Face's "
                             "convention)")
    export.add_argument("--sign", metavar="KEY", help="an elliptic-curve P-256/P-384/P-521 private key (PEM file): "
                        "sign the exported directory in the OpenSSF model-signing format (`model_signing verify key`)")
    export.add_argument("--signature", metavar="PATH", help="where --sign writes the signature (default: OUT_DIR.sig, "
                        "beside OUT_DIR; one inside OUT_DIR is recorded as ignored)")
    for keyed in (ls, verify, export):
        keyed.add_argument("--key", help="an Ed25519 public key (PEM file; default: $DISTCKPT_VERIFY_KEY): also "
                           "check each step's signature and BLAKE3 digests; a step it did not sign is BAD")
    for name, what in (("import-torch", "a torch.save file"), ("import-dcp", "a torch.distributed.checkpoint directory")):
        imp = sub.add_parser(name, help=f"{what} in, as a committed checkpoint")
        imp.add_argument("source", help=what)
        imp.add_argument("url", help="the new checkpoint root")
        imp.add_argument("--trust-pickle", action="store_true", help="required: the source is a pickle")
        imp.add_argument("--world-size", type=_whole, default=1, help="ranks of the job that will resume from it")
        imp.add_argument("--step", type=_step, help="the step to commit it as (default: its 'step', else 0)")
        imp.add_argument("--json", action="store_true")
    diff = command("diff", "what changed between two steps")
    diff.add_argument("a", type=_step)
    diff.add_argument("b", type=_step)
    # listed for --help only: main() hands `doctor` to doctor_main before this parser runs
    sub.add_parser("doctor", help="does the job resume bit for bit? runs it twice, kills one, compares "
                   "(distckpt doctor --help)", add_help=False)
    return p


_TAKES_A_VALUE = ("--max-shard-size", "--step", "--keep-last", "--keep-best", "--grace-s", "--world-size")


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


def _diff_values_as_positionals(argv: list[str]) -> list[str]:
    """`diff URL -1e+16 3`: argparse took '-1e+16' for an unknown option and said only "the following
    arguments are required: b". Behind '--' every value is a positional, judged by its own check;
    diff's flags (and their abbreviations) stay in front."""
    if argv[:1] != ["diff"] or "--" in argv:
        return argv
    flags = [a for a in argv[1:] if a == "-h" or (len(a) > 2 and any(f.startswith(a) for f in ("--json", "--help")))]
    return ["diff", *flags, "--", *(a for a in argv[1:] if a not in flags)]


def _refused_counts(args: argparse.Namespace) -> int | None:
    """The range checks argparse's types leave to the command (exit 2, said as one line or one JSON document)."""
    if getattr(args, "keep_last", 1) < 1:
        return fail(args, "--keep-last must be >= 1", EXIT_USAGE)
    if getattr(args, "keep_best", None) is not None and args.keep_best < 1:
        return fail(args, "--keep-best must be >= 1 (leave it out to keep no best steps beyond --keep-last)", EXIT_USAGE)
    return None


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["doctor"]:  # its own parser: everything after -- is the user's command
        return doctor_main(raw[1:])
    _ARGV[:] = list(argv or [])
    args = build_parser().parse_args(_diff_values_as_positionals(_joined_values(raw)))
    refused = _refused_counts(args)
    if refused is not None:
        return refused
    from distckpt.tools.cli_commands import run_command  # the heavy part (torch), once the arguments are good

    return run_command(args)


def _doctor_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="distckpt doctor", description="does the job resume bit for bit? names what breaks it")
    p.add_argument("--kill-at", type=_whole, help="SIGKILL a rank right after the commit of this step (default: the first)")
    p.add_argument("--steps", type=_whole, help="end both runs after the commit of this step (the manager exits the job)")
    p.add_argument("--kill-rank", type=_whole, help="which rank (default: the last)")
    p.add_argument("--every", type=_whole, help="also fingerprint the parameters every K optimizer steps, to find "
                   "the first differing step between checkpoints")
    p.add_argument("--resize", type=_whole, help="resume the killed run at this many ranks (torchrun processes per node; the "
                   "job uses world_size_policy='elastic'): report the sample accounting and the loss curves")
    p.add_argument("--workdir", help="where the two runs' roots go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds each run may take before it counts as hung and is killed (default 3600)")
    p.add_argument("--json", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command, as you run it")
    return p


def doctor_main(argv: list[str]) -> int:
    """`distckpt doctor`: its own parser, since everything after -- is the user's command."""
    _ARGV[:] = ["doctor", *argv]
    p = _doctor_parser()
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the launch command after --")
    for name, lowest in (("every", 1), ("steps", 1), ("kill_at", 0), ("kill_rank", 0)):
        if getattr(args, name) is not None and getattr(args, name) < lowest:
            p.error(f"--{name.replace('_', '-')} must be >= {lowest}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error("--timeout must be a positive number of seconds")
    import subprocess

    from distckpt.runtime.gcpause import collector_paused
    from distckpt.tools.doctor import report_json, report_text, run_doctor

    if args.resize is not None:
        return _doctor_resize(args, command)
    start = time.monotonic()
    try:
        with collector_paused():  # its own process compares whole states (gcpause.py)
            report = run_doctor(command, args.kill_at, args.kill_rank, args.workdir, timeout=args.timeout,
                                steps=args.steps, every=args.every,
                                announce=lambda line: print(f"distckpt doctor: {line}", file=sys.stderr, flush=True))
    except (DistCkptError, OSError, subprocess.TimeoutExpired) as e:
        args.command = "doctor"  # fail() names the command (args.command held the user's)
        message = str(e)
        if len(message) > 4000:  # the header (which run, how it ended, what it raised) stays
            head, _, rest = message.partition("its last output:")
            message = head[:1500] + "its last output (its end):\n..." + rest[-2500:]
        return fail(args, message, EXIT_USAGE)
    print(report_json(report) if args.json else report_text(report) + f"\n({time.monotonic() - start:.0f} s)")
    if report.identical:
        return EXIT_OK
    # 1 means "they differ" (a checkpoint, or the parameters' fingerprints); a check that compared
    # nothing after the kill (the kill step never reached, no common step after it) proved nothing
    return EXIT_PROBLEM if report.differs else EXIT_USAGE


def _doctor_resize(args: argparse.Namespace, command: list[str]) -> int:
    """`doctor --resize M` (tools/doctor_resize.py): exit 0 iff the interrupted epoch was fed exactly once."""
    import subprocess

    from distckpt.tools.doctor import _run
    from distckpt.tools.doctor_resize import resize_json, resize_text, run_resize

    try:
        report = run_resize(command, args.resize, args.kill_at, args.kill_rank, args.workdir, args.timeout, _run,
                            announce=lambda line: print(f"distckpt doctor: {line}", file=sys.stderr, flush=True))
    except (DistCkptError, OSError, subprocess.TimeoutExpired) as e:
        args.command = "doctor"
        return fail(args, str(e)[-4000:], EXIT_USAGE)
    print(resize_json(report) if args.json else resize_text(report))
    return EXIT_OK if report.exactly_once else EXIT_PROBLEM if report.records else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

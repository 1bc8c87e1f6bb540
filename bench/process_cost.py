"""What one operation costs in a process of its own: the parent side runs a child script, the
child side times the operation and measures its peak extra memory. Shared by bench/fresh.py,
bench/s3_fresh.py and bench/model_state.py, whose child scripts import it (run_child puts this
folder on their PYTHONPATH).

Peak extra memory is the process's peak resident set during the operation (VmHWM reset through
/proc/self/clear_refs just before it) minus its resident set before it; mapped file pages count.
A full garbage collection runs before the clock starts: the first one after the imports (~70 ms
with torch loaded) is owed by them and would otherwise land in whichever operation crosses the
collector's threshold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def measure(operation: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """Child side: run `operation` once; its result and {"seconds", "extra_mib"}."""
    import gc

    before = rss_kib("VmRSS:")
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    result = operation()
    seconds = time.perf_counter() - start
    peak = rss_kib("VmHWM:")
    return result, {"seconds": seconds, "extra_mib": (peak - before) / 1024}


def report(measured: dict[str, float]) -> None:
    """Child side: the measurement as the last line of stdout, which run_child reads."""
    print(json.dumps(measured))


def run_child(source: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Parent side: run `source` as a new Python process with `args`; its reported measurement."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", source, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0] if args else 'child'}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])

"""bench/cluster.py, the simulated cluster's benchmark, run for real at 2 nodes with a tiny state:
its rows exist for every write path, now and before (a baseline checkout through PYTHONPATH), the
shaped links were measured at their rate before the rows, the bytes to and from S3 were counted,
and nothing is left behind (namespaces, processes), after a full run, after SIGINT / SIGTERM
mid-run and after a job that fails. It needs root (network namespaces, tc), as `make bench-cluster` does."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "cluster.py")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="bench/cluster.py needs root: network namespaces, veths, tc"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="bench/cluster.py needs ip and tc (iproute2)"),
]
LINK_MBS = 10.0


def _leftovers(tag: str, work: str) -> list[str]:
    """Namespaces named with this run's tag, and processes naming its work folder or its tag."""
    spaces = [ln.split()[0] for ln in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                     text=True).stdout.splitlines() if ln.startswith(tag)]
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if work in cmdline or f"{tag}-" in cmdline:
            procs.append(f"{pid}: {cmdline[:200]}")
    return spaces + procs


def _started(line: str) -> tuple[str, str] | None:
    found = re.search(r"cluster (dcb[0-9a-f]+), work folder (\S+)", line)
    return (found.group(1), found.group(2)) if found else None


@pytest.mark.faults
def test_two_nodes_give_every_row_with_measured_shaping_and_leave_nothing(tmp_path):
    out = tmp_path / "cluster.md"
    baseline = tmp_path / "before"  # a checkout of its own: the before rows must import it, not ours
    shutil.copytree(os.path.join(ROOT, "distckpt"), baseline / "distckpt",
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, BENCH, "--nodes", "2", "--mib", "2", "--repeats", "1",
                           "--link-mbs", str(LINK_MBS), "--baseline", str(baseline), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    started = next(filter(None, map(_started, done.stdout.splitlines())))
    result = json.loads((tmp_path / "cluster.json").read_text())
    # the shaping, measured both ways on both nodes, at the asked rate (the harness refuses beyond)
    assert len(result["shaping"]) == 2
    for link in result["shaping"]:
        for way in ("up_mbs", "down_mbs"):
            assert 0.6 * LINK_MBS <= link[way] <= 1.15 * LINK_MBS, result["shaping"]
    assert result["interconnect_mbs"] > 5 * LINK_MBS  # node to node is not shaped
    rows = {(r["path"], r["code"]): r for r in result["rows"]}
    assert set(rows) == {(p, c) for p in ("rank0", "split", "sharded") for c in ("now", "before")}
    state = 2 * 2**20
    for (_path, code), row in rows.items():
        assert row["nodes"] == 2 and row["ranks"] == 4
        assert row["save_s"] > 0 and row["load_s"] > 0
        assert len(set(row["hosts"])) == 2 and row["hosts"][0] == row["hosts"][1]  # a host name per node
        # a save sends the state once (plus headers and small files); a load reads at least it
        assert state <= row["save_up"] < 1.5 * state, row
        assert row["load_down"] >= 0.9 * state, row
        # which distckpt ran: the baseline's through PYTHONPATH for "before"
        assert row["distckpt"] == str(baseline / "distckpt" if code == "before" else
                                      os.path.join(ROOT, "distckpt")), row
    # a save at this size takes at least its bytes over one shaped link: the shaping was in effect
    assert rows[("rank0", "now")]["save_s"] >= state / (LINK_MBS * 1e6) * 0.9
    table = out.read_text()
    assert table.count("| 2 x 2 |") == 7  # six rows and the ratios' row
    assert _leftovers(*started) == []


@pytest.mark.faults
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_removes_its_namespaces_and_processes(tmp_path, sig):
    proc = subprocess.Popen([sys.executable, BENCH, "--nodes", "2", "--mib", "2", "--repeats", "1",
                             "--baseline", "none", "--out", str(tmp_path / "c.md")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    started, lines = None, []
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # interrupted once the cluster is up and the job is running
        lines.append(line)
        started = started or _started(line)
        if line.startswith("links to S3 measured") or time.monotonic() > deadline:
            break
    assert started is not None, "".join(lines)
    time.sleep(3)  # torchrun agents and ranks starting in the namespaces
    proc.send_signal(sig)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, "".join(lines) + rest
    assert _leftovers(*started) == [], "".join(lines) + rest


@pytest.mark.faults
def test_a_failing_job_is_reported_with_its_log_and_leaves_nothing(tmp_path):
    broken = tmp_path / "broken" / "distckpt"  # a "before" checkout whose package cannot import
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this checkout is broken on purpose')\n")
    done = subprocess.run([sys.executable, BENCH, "--nodes", "2", "--mib", "1", "--repeats", "1", "--paths", "rank0",
                           "--baseline", str(broken.parent), "--out", str(tmp_path / "c.md")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "broken on purpose" in done.stderr, done.stderr[-3000:]  # the failing node's log, shown
    started = next(filter(None, map(_started, done.stdout.splitlines())))
    assert _leftovers(*started) == []
    assert not (tmp_path / "c.md").exists()


def test_refuses_clearly_without_root():
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run the harness as another user")
    done = subprocess.run(nobody + [sys.executable, BENCH, "--nodes", "1", "--baseline", "none"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs root" in done.stderr

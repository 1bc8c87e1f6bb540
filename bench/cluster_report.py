"""The simulated cluster's table (bench/cluster.py), with docs/design/scaling.md's model beside it.

The model column is bench/scaling.py's `predict` with this cluster's figures: the measured link
to S3 as each node's bound, 2 ranks per node, the protocol's constants of docs/design/scaling.md
(this 2-core machine's tiny-state rows), one process and the checksum far above the link. For
the "before" rows it is the model of that code (every rank reads a replicated file whole); for
the "now" rows, where `predict` takes `gloo_edge`, it models cooperative loads with the measured
node-to-node speed as that edge.
"""

from __future__ import annotations

import datetime
import inspect
import os
import platform
import statistics
from typing import Any

from scaling import Machine, predict

MIB = 2**20
NAMES = {"rank0": "rank 0 alone", "split": "split writes", "sharded": "sharded (FSDP2)"}
# docs/design/scaling.md, "What is measured": seconds per save / load = a + b x ranks (tiny state)
SAVE_PROTOCOL, LOAD_PROTOCOL = (8.9e-3, 3.60e-3), (0.0, 4.61e-3)


def model(run: Any, row: dict[str, Any]) -> dict[str, float]:
    link = statistics.mean(s[w] for s in run.shaping for w in ("up_mbs", "down_mbs")) * 1e6
    m = Machine(write_one=1.5 * 2**30, write_shared=link, copy=10 * 2**30, checksum=8 * 2**30,
                save_protocol=SAVE_PROTOCOL, load_protocol=LOAD_PROTOCOL)
    extra: dict[str, float] = {}
    if row["code"] == "now" and "gloo_edge" in inspect.signature(predict).parameters and run.interconnect_mbs:
        extra["gloo_edge"] = run.interconnect_mbs * 1e6  # where the model knows cooperative loads
    return predict(m, row["ranks"], run.args.mib * MIB, row["path"], run.args.ranks_per_node, 8,
                   **extra)


def _moved(row: dict[str, Any], op: str, state: float) -> str:
    total = row[f"{op}_up"] + row[f"{op}_down"]
    return f"{total / MIB:,.0f} ({total / state:.2f}x)"


def rows_table(run: Any) -> list[str]:
    state = run.args.mib * MIB
    lines = ["| nodes x ranks | path | code | save s | model save s | save: MiB to+from S3 (x state) | "
             "load s | model load s | load: MiB to+from S3 (x state) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in run.rows:
        m = model(run, row)
        lines.append(f"| {row['nodes']} x {run.args.ranks_per_node} | {NAMES[row['path']]} | {row['code']} | "
                     f"{row['save_s']:.2f} | {m['save']:.2f} | {_moved(row, 'save', state)} | "
                     f"{row['load_s']:.2f} | {m['load']:.2f} | {_moved(row, 'load', state)} |")
    return lines


def _find(run: Any, nodes: int, path: str, code: str) -> dict[str, Any] | None:
    return next((r for r in run.rows if (r["nodes"], r["path"], r["code"]) == (nodes, path, code)), None)


def ratios_table(run: Any) -> list[str]:
    """The ratios the design asks about, per node count (the same run's rows)."""
    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key_a: str, key_b: str) -> str:
        return f"{a[key_a] / b[key_b]:.2f}x" if a and b and b[key_b] > 0 else "—"

    lines = ["| nodes x ranks | split-writes save / rank 0 alone, now | same, before | "
             "replicated load now / before (rank 0 alone's checkpoint) | same (split checkpoint) | "
             "sharded save now / before | sharded load now / before |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for n in run.args.node_counts:
        f = lambda path, code, n=n: _find(run, n, path, code)  # noqa: E731
        lines.append(f"| {n} x {run.args.ranks_per_node} | {ratio(f('split', 'now'), f('rank0', 'now'), 'save_s', 'save_s')} | "
                     f"{ratio(f('split', 'before'), f('rank0', 'before'), 'save_s', 'save_s')} | "
                     f"{ratio(f('rank0', 'now'), f('rank0', 'before'), 'load_s', 'load_s')} | "
                     f"{ratio(f('split', 'now'), f('split', 'before'), 'load_s', 'load_s')} | "
                     f"{ratio(f('sharded', 'now'), f('sharded', 'before'), 'save_s', 'save_s')} | "
                     f"{ratio(f('sharded', 'now'), f('sharded', 'before'), 'load_s', 'load_s')} |")
    return lines


def report(run: Any, baseline_said: str, seconds: float, argv: list[str]) -> str:
    a = run.args
    shaped = "; ".join(f"node {i}: {s['up_mbs']:.1f} up, {s['down_mbs']:.1f} down" for i, s in enumerate(run.shaping))
    inter = f"{run.interconnect_mbs:,.0f} MB/s (one TCP stream, unshaped)" if run.interconnect_mbs else \
        "not measured (one node)"
    head = [f"Command: `python bench/cluster.py{' ' + ' '.join(argv) if argv else ''}` (as root); "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
            f"{platform.platform()}; whole run {seconds:.0f} s.",
            "",
            f"* State: {a.mib:g} MiB (8 float32 tensors, replicated on every rank; the sharded rows: an FSDP2 "
            f"model of {a.mib:g} MiB in all), {a.ranks_per_node} ranks per node, the fastest of {a.repeats} (the CPUs are shared with other work; every repeat is in the JSON beside the table).",
            f"* Each node's link to S3 shaped to {a.link_mbs:g} MB/s each way (tc htb); measured with a raw TCP "
            f"transfer before the rows (MB/s): {shaped}. Node to node (gloo): {inter}.",
            f"* {baseline_said}. \"now\": the code of this checkout.",
            "* Times: the slowest rank's; a load is a fresh manager plus `load_latest`, checked bit for bit. "
            "Bytes: counted by the shaped tc classes (IP packets to and from the S3 server, headers included).",
            ""]
    return "\n".join(head + rows_table(run) + [""] + ratios_table(run)) + "\n"


DOCS_PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks", "cluster.md")


def into_docs(text: str, page: str = DOCS_PAGE) -> None:
    """The table in the docs page, between its cluster-table markers (`--docs`)."""
    with open(page) as f:
        doc = f.read()
    start, end = "<!-- cluster-table -->\n", "<!-- /cluster-table -->"
    if start not in doc or end not in doc:
        raise SystemExit(f"{page}: no {start.strip()} ... {end} markers to put the table between")
    head, rest = doc.split(start, 1)
    with open(page, "w") as f:
        f.write(head + start + text + rest[rest.index(end):])

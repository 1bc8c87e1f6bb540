"""Samples of the interrupted epoch missed and repeated after a resume at another world size:
world_size_policy="reshard" (each rank restarts its epoch) against "elastic", measured from the
outside (each rank logs the sample ids of every step) on a real torchrun DDP job: 96 samples,
DistributedSampler(shuffle=True) + StatefulDataLoader, batch 2, saved after 6 steps of epoch 0.

    python bench/elastic_accounting.py [--workers 0]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers"))

from elastic_runs import run_elastic  # noqa: E402

from distckpt.state.elastic import Order  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=0)
    a = p.parse_args()
    print("| resize | policy | samples of epoch 0 consumed | missed | repeated |")
    print("|---|---|---|---|---|")
    for old, new in ((4, 2), (2, 4)):
        reference = collections.Counter(Order(96, old, True, False, 7, 0).global_indices())
        for policy in ("reshard", "elastic"):
            with tempfile.TemporaryDirectory() as tmp:
                result = run_elastic(tmp, old, new, save_at=5, extra=["--workers", str(a.workers), "--policy", policy])
                if result.rc[1] != 0:
                    raise SystemExit(result.output)
                got = collections.Counter(result.consumed(0, 5))
            missed, repeated = reference - got, got - reference
            print(f"| {old} -> {new} | {policy} | {sum(got.values())} | {sum(missed.values())} | "
                  f"{sum(repeated.values())} |", flush=True)


if __name__ == "__main__":
    main()

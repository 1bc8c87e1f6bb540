"""SIGKILL of a real rank at every named point of save and load, on local disk and on S3.

The promise checked after each kill: the surviving rank raises a distckpt error within the
timeout (never hangs); a fresh world then loads the previous or the new checkpoint — exactly
the one the kill point implies — byte-identical on every rank; and the next save succeeds.

`make test` runs a sample that covers both backends, both ranks and save and load; the whole
matrix runs with `make test-faults` (pytest -m faults).
"""

from __future__ import annotations

import crash_workers
import pytest

from distckpt.testing import run_world
from distckpt.tools.cli import main as cli_main

# (point, rank killed, the step a restart must resume from)
MATRIX = [
    ("save/captured", 0, 1), ("save/captured", 1, 1),
    ("save/gathered", 0, 1),
    ("save/replicated-written", 0, 1),
    ("save/rank-files-written", 0, 1), ("save/rank-files-written", 1, 1),
    ("save/manifest-written", 0, 1),
    ("save/committed", 0, 2),
    ("save/retained", 0, 2),
    ("save/awaiting-commit", 1, 2),
    ("load/read", 0, 2), ("load/read", 1, 2),
    ("load/applied", 0, 2), ("load/applied", 1, 2),
]
SAMPLE = {("local", "save/captured", 1), ("local", "save/rank-files-written", 1), ("local", "save/manifest-written", 0), ("local", "load/applied", 1),
          ("s3", "save/committed", 0), ("s3", "save/awaiting-commit", 1)}
CASES = [pytest.param(backend, point, victim, expect, id=f"{backend}-{point}-rank{victim}",
                      marks=() if (backend, point, victim) in SAMPLE else pytest.mark.faults)
         for backend in ("local", "s3") for point, victim, expect in MATRIX]


@pytest.mark.parametrize("backend,point,victim,expect", CASES)
def test_sigkill_at_every_point(backend, point, victim, expect, tmp_path, request):
    if backend == "local":
        url, options = str(tmp_path / "ckpt"), None
    else:
        server = request.getfixturevalue("s3_server")
        url, options = request.getfixturevalue("s3_url"), server.storage_options()

    results = run_world("crash_workers:crash_during", 2, url=url, options=options, point=point, victim=victim)
    killed, survivor = results[victim], results[1 - victim]
    assert killed.exitcode == -9, killed
    assert survivor.exitcode is None and survivor.error_type is None, survivor  # returned, did not crash
    report = survivor.value
    assert report["error_type"] is not None, f"the survivor reported success after rank {victim} died: {report}"
    assert report["seconds"] < crash_workers.TIMEOUT_S + 5, report  # an error within the timeout, never a hang
    # On one machine a dead peer is noticed, not waited out: the collectives see its closed
    # connections, rank 0's wait for the ranks' reports its process gone (was the whole timeout)
    assert report["seconds"] < crash_workers.TIMEOUT_S / 2, report
    print(f"\n[crash] {backend} {point} rank {victim} killed: survivor raised {report['error_type']} "
          f"after {report['seconds']:.2f}s; resumed from step {expect}")

    resumed = run_world("crash_workers:resume_and_continue", 2, url=url, options=options)
    for r in resumed:
        assert r.error_type is None, r.error
        assert r.value["step"] == expect, (r.rank, r.value)
        assert r.value["loaded"] == r.value["expected"], f"rank {r.rank}: step {expect} did not load byte-identical"
        assert r.value["next"] == (expect + 1, True), r.value
    if backend == "local":
        assert cli_main(["verify", url, "--all"]) == 0

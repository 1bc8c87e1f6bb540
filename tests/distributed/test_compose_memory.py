"""The memory tier's compose variant (docker/compose.memory.yaml, `make compose-demo-memory`) checked
at the level of its files: each node a machine with its own /dev/shm large enough for the memory
tier, the job with the memory tier on, the nodes reaching S3 through the counting proxy, and the
proxy (launch/s3count.py) counting for real in front of SeaweedFS what a client read. The cluster
itself runs under a container engine in .ci/run (make compose-demo-memory), not here."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import yaml

from distckpt.protocol.memory_tier import HEADROOM_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "docker", "compose.yaml")
MEMORY = os.path.join(ROOT, "docker", "compose.memory.yaml")
S3COUNT = os.path.join(ROOT, "launch", "s3count.py")


def load(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def merged_node(name: str) -> dict:
    """A node service as compose merges the two files: the override's keys win, environment by key."""
    base, over = load(BASE)["services"][name], load(MEMORY)["services"][name]
    return {**base, **over, "environment": {**base["environment"], **over["environment"]},
            "depends_on": {**base["depends_on"], **over["depends_on"]}}


def size_bytes(text: str) -> int:
    """compose's byte sizes: 256m, 1g, 512k, 1048576."""
    number, unit = re.fullmatch(r"(\d+)([bkmg]?)", str(text).lower()).groups()
    return int(number) << {"": 0, "b": 0, "k": 10, "m": 20, "g": 30}[unit]


def flag_value(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_memory_variant_gives_each_node_its_own_shm_the_memory_tier_and_the_counting_proxy():
    services = load(MEMORY)["services"]
    proxy = services["s3count"]["command"]
    assert proxy[:2] == ["python", "launch/s3count.py"]
    usage = subprocess.run([sys.executable, S3COUNT, "--help"], capture_output=True, text=True, check=True).stdout
    assert all(option in usage for option in proxy[2:] if option.startswith("--"))
    listen_port = flag_value(proxy, "--listen").rsplit(":", 1)[1]
    serve = load(BASE)["services"]["s3"]["command"]
    # the proxy forwards to the S3 service's port, and logs where the demo reads (/logs, the host's directory)
    assert flag_value(proxy, "--upstream") == f"s3:{flag_value(serve, '--s3-port')}"
    assert flag_value(proxy, "--log").startswith("/logs/")
    assert services["s3count"]["volumes"] == load(BASE)["services"]["node0"]["volumes"]
    for name in ("node0", "node1"):
        node = merged_node(name)
        # a fresh container per node has its own /dev/shm: bigger than the memory tier's headroom alone
        # (docker's default of 64 MiB is exactly the headroom: every save would raise MemoryTierFullError)
        assert size_bytes(node["shm_size"]) > HEADROOM_BYTES, name
        assert node["environment"]["MEMORY_TIER"] == "1", name
        assert node["environment"]["AWS_ENDPOINT_URL"] == f"http://s3count:{listen_port}", name
        assert "s3count" in node["depends_on"] and "bucket" in node["depends_on"], name
        # a machine that stays up between jobs (its /dev/shm with it), zombies reaped by the init
        assert node["command"] == ["sleep", "infinity"] and node["init"] is True, name
        assert node["hostname"] == name  # the rendezvous orders nodes by host name: node 0 stays node 0


def test_the_plain_compose_file_is_unchanged_by_the_variant():
    for name in ("node0", "node1"):
        node = load(BASE)["services"][name]
        assert "shm_size" not in node and "MEMORY_TIER" not in node["environment"], name
        assert node["command"] == ["launch/node.sh"] and node["environment"]["AWS_ENDPOINT_URL"] == "http://s3:8333"
    assert "s3count" not in load(BASE)["services"]


def test_node_sh_turns_the_memory_tier_on_and_train_py_accepts_it():
    text = open(os.path.join(ROOT, "launch", "node.sh")).read()
    assert '${MEMORY_TIER:+--memory-tier}' in text and ': "${MEMORY_TIER:=}"' in text
    help_text = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--help"],
                               capture_output=True, text=True, check=True).stdout
    for option in ("--memory-tier", "--memory-every", "--keep-memory"):
        assert option in help_text


def test_make_compose_demo_memory_runs_the_variant_and_ci_runs_it_after_compose_demo():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert "compose-demo-memory" in re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    recipe = re.search(r"^compose-demo-memory:.*\n\t(.+)$", makefile, re.M).group(1)
    assert "launch/compose_demo.py" in recipe and "--memory-tier" in recipe
    ci = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run")) if line.startswith("make ")]
    assert ci.index("make compose-demo-memory") > ci.index("make compose-demo")
    import compose_demo

    assert compose_demo.MEMORY_COMPOSE_FILE == MEMORY and compose_demo.MEMORY_PROJECT != compose_demo.PROJECT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3count(s3_server, tmp_path):
    """launch/s3count.py in front of the session's SeaweedFS: (its storage options, its log's path)."""
    port, log = _free_port(), str(tmp_path / "requests.jsonl")
    proc = subprocess.Popen([sys.executable, S3COUNT, "--listen", f"127.0.0.1:{port}",
                             "--upstream", f"127.0.0.1:{s3_server.s3_port}", "--log", log])
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "s3count did not start"
            time.sleep(0.1)
    yield s3_server.storage_options(f"http://127.0.0.1:{port}"), log
    proc.kill()
    proc.wait()


def test_s3count_logs_each_request_with_the_bytes_the_client_read(s3count, s3_url):
    import compose_memory
    import s3fs

    options, log = s3count
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    root = s3_url[len("s3://"):]
    payload = os.urandom(300_000)
    fs.pipe(f"{root}/step-000000010/rank-00000.pt", payload)
    assert fs.ls(f"{root}/step-000000010/") and fs.cat(f"{root}/step-000000010/rank-00000.pt") == payload
    deadline = time.monotonic() + 10
    while not any(r.method == "GET" and r.payload for r in compose_memory.read_requests(log)):
        assert time.monotonic() < deadline, open(log).read()
        time.sleep(0.1)
    requests = compose_memory.read_requests(log)
    everything = compose_memory.window(requests, 0, time.time() + 60)
    assert everything.payload_get_bytes == len(payload)  # the object's GET, and no listing, counted as payload
    assert [r for r in requests if r.method == "GET" and not r.payload]  # the listing
    bucket, run = root.split("/", 1)
    assert compose_memory.uploaded_step_bytes(requests, bucket, run, 10) >= len(payload)
    assert compose_memory.uploaded_step_bytes(requests, bucket, run, 20) == 0
    assert compose_memory.window(requests, 0, requests[0].t - 1).requests == []


def test_the_resume_and_load_lines_of_train_py_are_parsed(tmp_path):
    import compose_memory

    lines = ["0 0x1.0p+0 epoch=0 t=1.0", "1 0x1.0p+0 epoch=0 t=2.0",
             "# resumed from step 10 epoch 0 (peer tier)", "# load_latest 0.812 s, returned at 1765100000.250000",
             "11 0x1.0p+0 epoch=0 t=3.0"]
    (tmp_path / "rank-0.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "rank-1.txt").write_text("\n".join(lines[:3]) + "\n")  # resumed, its load line not written yet
    (tmp_path / "rank-2.txt").write_text("\n".join(lines[:2]) + "\n")  # never resumed
    loads = compose_memory.read_loads(str(tmp_path))
    assert loads == {0: compose_memory.Load(10, "peer", 0.812, 1765100000.25)}
    assert compose_memory.steps_after_resume(str(tmp_path), 0) == [11]
    assert compose_memory.steps_after_resume(str(tmp_path), 1) == []
    assert compose_memory.steps_after_resume(str(tmp_path), 2) == []  # steps of a fresh start are no resume
    # train.py writes exactly these lines: its format strings are the ones parsed here
    train = open(os.path.join(ROOT, "launch", "train.py")).read()
    assert '# resumed from step {progress.step} epoch {progress.epoch}{tier}' in train
    assert 'tier = f" ({progress.tier} tier)"' in train
    assert '# load_latest {load_seconds:.3f} s, returned at {time.time():.6f}' in train


def _write_run(tmp_path, tier: str, restore_gets: list[tuple[str, int]]):
    """A killed run's loss logs (4 ranks, resumed step 10 from `tier`) and S3's request log with
    `restore_gets` (path, bytes) answered during the restore; returns (MemoryRun, logs, requests log)."""
    import compose_memory

    logs = tmp_path / "killed"
    logs.mkdir()
    restart = 1000.0
    for rank in range(4):
        (logs / f"rank-{rank}.txt").write_text(
            f"# resumed from step 10 epoch 0 ({tier} tier)\n# load_latest 0.200 s, returned at {restart + 20:.6f}\n"
            "11 0x1.0p+0 epoch=0 t=1.0\n")
    requests = [{"t": 10.0, "method": "PUT", "path": "/ckpt/killed/step-000000010/replicated/state.safetensors",
                 "status": 200, "bytes": 0, "sent": 5000},
                {"t": restart + 5, "method": "GET", "path": "/ckpt?list-type=2&prefix=killed%2F", "status": 200,
                 "bytes": 400, "sent": 0}]
    requests += [{"t": restart + 6, "method": "GET", "path": path, "status": 200, "bytes": n, "sent": 0}
                 for path, n in restore_gets]
    requests.append({"t": restart + 60, "method": "GET", "path": "/ckpt/killed/step-000000020/manifest.json",
                     "status": 200, "bytes": 900, "sent": 0})  # after the load: not the restore's
    log = tmp_path / "s3-requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in requests))
    run = compose_memory.MemoryRun([10], restart, 25.0, 1.0, ["distckpt/x-node0/own/step-000000010"])
    return run, str(logs), str(log)


def test_the_memory_demo_passes_a_peer_restore_that_read_no_step_directory(tmp_path, capsys):
    import compose_memory

    run, logs, log = _write_run(tmp_path, "peer", [("/ckpt/killed/fence/gen-000000001.json", 155)])
    assert compose_memory.memory_verdict(run, logs, log, "ckpt", node=1, per_node=2, world=4) == []
    out = capsys.readouterr().out
    assert "GETs of step directories: 0 bytes (step 10 is 5000 bytes in S3)" in out
    assert "2 requests, 555 bytes in all" in out  # the step-20 GET after the load is not counted


@pytest.mark.parametrize("tier, gets, why", [
    ("durable", [], "from the peer tier"),
    ("memory", [], "from the peer tier"),
    ("peer", [("/ckpt/killed/step-000000010/ranks/rank-00002.safetensors", 3000)], "read step directories"),
    ("peer", [("/ckpt/killed/step-000000010/COMMITTED", 211)], "read step directories"),
])
def test_the_memory_demo_fails_a_restore_from_another_tier_or_one_that_read_the_step_from_s3(tmp_path, tier, gets,
                                                                                               why):
    import compose_memory

    run, logs, log = _write_run(tmp_path, tier, gets)
    failures = compose_memory.memory_verdict(run, logs, log, "ckpt", node=1, per_node=2, world=4)
    assert len(failures) == 1 and why in failures[0], failures


def test_the_memory_demo_fails_when_a_rank_did_not_log_its_resume(tmp_path):
    import compose_memory

    run, logs, log = _write_run(tmp_path, "peer", [])
    os.remove(os.path.join(logs, "rank-3.txt"))
    failures = compose_memory.memory_verdict(run, logs, log, "ckpt", node=1, per_node=2, world=4)
    assert len(failures) == 1 and "every rank of 4" in failures[0], failures


def test_the_memory_demo_fails_when_s3_was_not_counted(tmp_path):
    import compose_memory

    run, logs, log = _write_run(tmp_path, "peer", [])
    os.remove(log)  # the nodes bypassed the proxy, or it logged nowhere
    failures = compose_memory.memory_verdict(run, logs, log, "ckpt", node=1, per_node=2, world=4)
    assert any("no S3 request counted" in f for f in failures) and any("no upload" in f for f in failures)

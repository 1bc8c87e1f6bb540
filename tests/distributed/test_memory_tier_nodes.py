"""The memory tier on two nodes: two torchrun agents on one machine (--nnodes 2 --node-rank i), each
with its own memory namespace (DISTCKPT_MEMORY_DIR), checkpointing to SeaweedFS through a proxy
that counts the bytes it serves.

A node is lost (its workers SIGKILLed, its memory directory removed: the node replaced); both
agents restart; the lost node's ranks get their files from the partner's copy over the process
group; every loss after the resume is bitwise the uninterrupted run's; the restore reads no byte
of any step directory from S3 (listings and the fence's leases only).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from distckpt.protocol.commit import list_committed
from distckpt.storage import open_storage

HELPERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers")
LOOP = os.path.join(HELPERS, "memory_loop.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp, tag: str, url: str, endpoint: str, steps: int, nproc: int = 1, extra: tuple[str, ...] = (),
           memory: str | None = None, env_extra: dict | None = None) -> list[subprocess.Popen]:
    """Two agents, node 0 and node 1, each with its own memory dir under `memory` (tmp/mem)."""
    logs = os.path.join(tmp, f"logs-{tag}")
    os.makedirs(logs, exist_ok=True)
    port = _free_port()
    agents = []
    for node in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([HELPERS, os.getcwd()]),
               "DISTCKPT_MEMORY_DIR": os.path.join(memory or os.path.join(tmp, f"mem-{tag}"), f"node{node}"),
               "DISTCKPT_NODE": f"node{node}",  # the local tier's node identity: the host name repeats here
               **(env_extra or {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "0", LOOP, url, logs, str(steps), "--options", endpoint, *extra]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True))
    return agents


def finish(agents: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outs = []
    for agent in agents:
        out, _ = agent.communicate(timeout=timeout)
        outs.append(out)
        assert agent.returncode == 0, out[-4000:]
    return outs


def kill_all(agents: list[subprocess.Popen], first: int = 0, timeout: float = 120) -> None:
    """Wait for agent `first` (a worker SIGKILLed itself) to end, then SIGKILL the other agents'
    whole process groups: the lost node and its peer's stuck workers, as a dead node leaves them."""
    agents[first].communicate(timeout=timeout)
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.communicate(timeout=30)


def losses(logs: str, rank: int) -> dict[int, str]:
    out = {}
    for line in open(os.path.join(logs, f"rank-{rank}.txt")):
        if not line.startswith("#"):
            step, value = line.split()
            out[int(step)] = value  # the resumed run's lines come last: they win
    return out


def resumes(logs: str, rank: int) -> list[list[str]]:
    return [line.split()[2:] if " resumed " in line else ["fresh"] for line in open(os.path.join(logs, f"rank-{rank}.txt")) if line.startswith("#")]


class _Via:
    """The proxy, and the storage options that reach the S3 server through it (JSON, for argv)."""

    def __init__(self, proxy, s3_server) -> None:
        self.proxy = proxy
        self.endpoint = json.dumps(s3_server.storage_options(proxy.endpoint))

    def __getattr__(self, name):
        return getattr(self.proxy, name)


@pytest.fixture
def via_proxy(proxy, s3_server, s3_url):
    return s3_url, _Via(proxy, s3_server)


def _reference(tmp, url: str, endpoint: str, steps: int, nproc: int) -> str:
    finish(launch(tmp, "ref", url + "-ref", endpoint, steps, nproc))
    return os.path.join(tmp, "logs-ref")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.faults)])  # 2 x 2 ranks: make test-faults
def test_a_replaced_node_resumes_from_its_partners_memory_bitwise_reading_no_payload_from_s3(tmp_path, via_proxy,
                                                                                             nproc):
    url, proxy = via_proxy
    tmp, steps, kill = str(tmp_path), 9, 5
    reference = _reference(tmp, url, proxy.endpoint, steps, nproc)
    kill_all(launch(tmp, "run", url, proxy.endpoint, steps, nproc, ("--kill-at", f"{kill}:0")))
    shutil.rmtree(os.path.join(tmp, "mem-run", "node1"))  # node 1 replaced: its shared memory is gone
    proxy.clear()
    finish(launch(tmp, "run", url, proxy.endpoint, steps, nproc, ("--no-save-after-resume",)))
    logs, world = os.path.join(tmp, "logs-run"), 2 * nproc
    for rank in range(world):
        assert resumes(logs, rank)[-1][:2] == [str(kill), "peer"], resumes(logs, rank)
        assert losses(logs, rank) == losses(reference, rank)  # float.hex: bitwise
        assert sorted(losses(logs, rank)) == list(range(steps))
    payload = proxy.bytes_served("GET", r"step-\d+")
    assert payload == 0, [e for e in proxy.served if "step-" in e[1]][:5]
    print(f"restore of node 1 from its partner: load_latest {resumes(logs, 2 * nproc - 1)[-1][2]} s; "
          f"S3 served {sum(n for _, _, n in proxy.served)} bytes in {len(proxy.served)} requests, "
          f"{payload} of them from step directories")
    gets = [p for m, p, _ in proxy.served if m == "GET"]
    assert gets and all("list-type" in p or "/fence/" in p or "prefix=" in p for p in gets), gets[:10]


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.faults)])
def test_a_step_saved_to_memory_only_resumes_a_replaced_node_from_its_partner(tmp_path, via_proxy, async_save):
    """Memory every step, S3 at the first save and every 4th after it (disk_every=4): the killed
    step 5 is held in memory alone (S3's newest is step 4); the replaced node resumes it from its
    partner, bit for bit."""
    url, proxy = via_proxy
    tmp, extra = str(tmp_path), ("--disk-every", "4") + (("--async",) if async_save else ())
    finish(launch(tmp, "ref", url + "-ref", proxy.endpoint, 8, 1, extra))
    # the finished job's close() wrote its last step, saved to memory only, to S3 from both nodes' copies
    assert list_committed(open_storage(url + "-ref", json.loads(proxy.endpoint))) == [7, 4, 0]
    kill_all(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--kill-at", "5:0", *extra)))
    assert list_committed(open_storage(url, json.loads(proxy.endpoint))) == [4, 0]  # step 5 in memory only
    shutil.rmtree(os.path.join(tmp, "mem-run", "node1"))
    proxy.clear()
    finish(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--no-save-after-resume", *extra)))
    logs, reference = os.path.join(tmp, "logs-run"), os.path.join(tmp, "logs-ref")
    assert [resumes(logs, r)[-1][:2] for r in (0, 1)] == [["5", "peer"]] * 2
    assert all(losses(logs, r) == losses(reference, r) for r in (0, 1))
    assert proxy.bytes_served("GET", r"step-\d+") == 0


@pytest.mark.slow
@pytest.mark.faults
def test_fsdp2_a_replaced_node_gets_its_shards_from_its_partner(tmp_path, via_proxy):
    url, proxy = via_proxy
    tmp = str(tmp_path)
    finish(launch(tmp, "ref", url + "-ref", proxy.endpoint, 8, 1, ("--fsdp",)))
    kill_all(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--fsdp", "--kill-at", "4:0")))
    shutil.rmtree(os.path.join(tmp, "mem-run", "node1"))
    proxy.clear()
    finish(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--fsdp", "--no-save-after-resume")))
    logs, reference = os.path.join(tmp, "logs-run"), os.path.join(tmp, "logs-ref")
    assert [resumes(logs, r)[-1][:2] for r in (0, 1)] == [["4", "peer"]] * 2
    assert all(losses(logs, r) == losses(reference, r) for r in (0, 1))
    assert proxy.bytes_served("GET", r"step-\d+") == 0


@pytest.mark.slow
@pytest.mark.faults
def test_with_two_tiers_a_replaced_node_that_lost_memory_and_disk_resumes_from_its_partner(tmp_path, via_proxy):
    url, proxy = via_proxy
    tmp = str(tmp_path)
    tiers = ("--local-dir", os.path.join(tmp, "local-{node}"), "--durable-every", "3")
    reference = _reference(tmp, url, proxy.endpoint, 8, 1)
    kill_all(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--kill-at", "4:0", *tiers)))
    shutil.rmtree(os.path.join(tmp, "mem-run", "node1"))  # node 1 replaced: memory and local disk gone
    shutil.rmtree(os.path.join(tmp, "local-1"))
    proxy.clear()
    finish(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--no-save-after-resume", *tiers)))
    logs = os.path.join(tmp, "logs-run")
    assert [resumes(logs, r)[-1][:2] for r in (0, 1)] == [["4", "peer"]] * 2
    assert all(losses(logs, r) == losses(reference, r) for r in (0, 1))
    assert proxy.bytes_served("GET", r"step-\d+") == 0


@pytest.mark.slow
@pytest.mark.faults  # make test-faults (make test: the replaced node, from its partner)
def test_a_restarted_node_with_its_memory_resumes_from_its_own_copy(tmp_path, via_proxy):
    url, proxy = via_proxy
    tmp = str(tmp_path)
    kill_all(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--kill-at", "4:1")), first=1)
    proxy.clear()
    finish(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--no-save-after-resume",)))
    logs = os.path.join(tmp, "logs-run")
    assert [resumes(logs, r)[-1][:2] for r in (0, 1)] == [["4", "memory"]] * 2
    assert proxy.bytes_served("GET", r"step-\d+") == 0


@pytest.mark.slow
@pytest.mark.faults
def test_both_nodes_lost_resumes_from_the_durable_tier_with_a_warning(tmp_path, via_proxy):
    url, proxy = via_proxy
    tmp = str(tmp_path)
    reference = _reference(tmp, url, proxy.endpoint, 8, 1)
    kill_all(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--kill-at", "4:0")))
    shutil.rmtree(os.path.join(tmp, "mem-run"))
    outs = finish(launch(tmp, "run", url, proxy.endpoint, 8, 1))
    logs = os.path.join(tmp, "logs-run")
    assert [resumes(logs, r)[-1][:2] for r in (0, 1)] == [["4", "durable"]] * 2
    assert "not resuming from the memory tier" in outs[0]
    assert all(losses(logs, r) == losses(reference, r) for r in (0, 1))


@pytest.mark.slow
@pytest.mark.faults
def test_a_damaged_partner_copy_falls_back_to_the_durable_tier(tmp_path, via_proxy):
    url, proxy = via_proxy
    tmp = str(tmp_path)
    kill_all(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--kill-at", "4:0")))
    shutil.rmtree(os.path.join(tmp, "mem-run", "node1"))
    peer = os.path.join(tmp, "mem-run", "node0", "peer", "node-1")
    for step_dir in os.listdir(peer):  # every partner copy of node 1 damaged: one byte of its rank file
        for name in os.listdir(os.path.join(peer, step_dir)):
            if name.startswith("rank-") or name.startswith("ranks"):
                path = os.path.join(peer, step_dir, name)
                target = path if os.path.isfile(path) else os.path.join(path, os.listdir(path)[0])
                with open(target, "r+b") as f:
                    f.seek(20)
                    byte = f.read(1)
                    f.seek(20)
                    f.write(bytes([byte[0] ^ 1]))
    outs = finish(launch(tmp, "run", url, proxy.endpoint, 8, 1))
    logs = os.path.join(tmp, "logs-run")
    assert [resumes(logs, r)[-1][:2] for r in (0, 1)] == [["4", "durable"]] * 2
    assert "cannot be used" in "".join(outs), outs[0][-3000:]


@pytest.fixture(scope="module")
def reference_8(s3_server, tmp_path_factory):
    """The uninterrupted run of 8 steps, 2 nodes x 1 rank: its loss logs."""
    tmp = str(tmp_path_factory.mktemp("memory-reference"))
    finish(launch(tmp, "ref", "s3://ckpt/memory-reference-8", json.dumps(s3_server.storage_options()), 8, 1))
    return os.path.join(tmp, "logs-ref")


# (fault point[@area], the rank SIGKILLed there, the tier the restart resumes step 3 from)
KILLS = [
    ("memory/exchanged", 1, "peer"),         # node 1 dies before writing: node 0 holds its partner copy
    ("memory/files-writing", 1, "peer"),     # node 1 dies writing its own copy
    ("memory/committed", 1, "memory"),       # node 1's own copy committed; dies before its partner copy
    ("memory/files-writing@peer", 1, "memory"),  # a partner dying during its copy: the own copies stand
    ("memory/exchanged", 0, "peer"),         # node 0 dies before writing: node 1 holds its partner copy
]


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.parametrize("point, rank, tier", KILLS)
def test_sigkill_at_a_memory_commit_point_resumes_bitwise(tmp_path, via_proxy, reference_8, point, rank, tier):
    url, proxy = via_proxy
    tmp = str(tmp_path)
    kill_all(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--fault", f"{point}:{rank}")), first=rank)
    proxy.clear()
    finish(launch(tmp, "run", url, proxy.endpoint, 8, 1, ("--no-save-after-resume",)))
    logs = os.path.join(tmp, "logs-run")
    assert [resumes(logs, r)[-1][:2] for r in (0, 1)] == [["3", tier]] * 2
    assert all(losses(logs, r) == losses(reference_8, r) for r in (0, 1))
    assert proxy.bytes_served("GET", r"step-\d+") == 0


@pytest.mark.slow
def test_two_nodes_given_one_memory_dir_are_refused_on_every_rank(tmp_path, via_proxy):
    url, proxy = via_proxy
    tmp = str(tmp_path)
    agents = launch(tmp, "shared", url, proxy.endpoint, 2, 1,
                    env_extra={"DISTCKPT_MEMORY_DIR": os.path.join(tmp, "one-dir")})
    outs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert all(agent.returncode != 0 for agent in agents), [o[-2000:] for o in outs]
    for out in outs:  # every node's rank says why, at construction, before any save
        assert "nodes 0 and 1 (GROUP_RANK) on host" in out and "share the memory root" in out, out[-3000:]
    assert not os.path.exists(os.path.join(tmp, "one-dir", "own")), os.listdir(os.path.join(tmp, "one-dir"))

"""The simulated cluster's network: network namespaces, one bridge, tc shaping toward the S3 server.

Every piece lives in a namespace of its own, so nothing is added to the host's network and
deleting the namespaces removes every interface with them:

    <tag>-sw   the "switch": one bridge, with one veth per node and one for the server
    <tag>-s3   the S3 server (SeaweedFS), 10.77.0.2
    <tag>-nI   node I, 10.77.0.(10+I), its veth named eth0

Shaping (htb, one class per direction and node) applies only to traffic between a node and the
server: a u32 filter on the server's address sends it to a class of `link_mbs` MB/s; everything
else (node to node: gloo) matches no class and leaves unshaped (htb's `default 0`). Upload
(node -> server) is shaped on the node's eth0, download (server -> node) on the switch's port
toward the node, so no ifb device is needed. The same classes count the bytes moved to and from
S3 (`tc -s class show`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

SUBNET = "10.77.0"
SERVER_IP = f"{SUBNET}.2"
SHAPED = "1:10"  # the htb class of node <-> server traffic, on both directions' devices


def node_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def refusal(who: str = "bench/cluster.py") -> str | None:
    """Why this machine cannot build the cluster for `who`, or None."""
    if os.geteuid() != 0:
        return f"{who} needs root: it creates network namespaces, veths, a bridge and tc qdiscs"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{who} needs {' and '.join(missing)} (iproute2) on PATH"
    return None


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def our_namespaces(prefix: str = "dcb") -> list[str]:
    """Namespaces whose names start with `prefix` (left over, or this run's)."""
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


@dataclass
class Cluster:
    """N node namespaces and a server namespace on one bridge; `build()` then `teardown()`."""

    nodes: int
    link_mbs: float  # MB/s (10**6 bytes) each way between each node and the server
    tag: str = field(default_factory=lambda: "dcb" + secrets.token_hex(2))
    built: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @property
    def server(self) -> str:
        return f"{self.tag}-s3"

    def node(self, i: int) -> str:
        return f"{self.tag}-n{i}"

    def build(self) -> "Cluster":
        self._namespace(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        self._attach(self.server, "s3", SERVER_IP)
        for i in range(self.nodes):
            self._attach(self.node(i), f"n{i}", node_ip(i))
            rate = f"{self.link_mbs * 8:.3f}mbit"
            self._shape(self.node(i), "eth0", rate, "dst")  # upload: node -> server
            self._shape(self.switch, f"n{i}", rate, "src")  # download: server -> node
        return self

    def _namespace(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.built.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _attach(self, ns: str, port: str, ip: str) -> None:
        """A namespace with eth0 at `ip`, its peer `port` on the switch's bridge."""
        self._namespace(ns)
        sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def _shape(self, ns: str, dev: str, rate: str, direction: str) -> None:
        """Only packets to (dst) / from (src) the server go through the shaped class."""
        tc = ("ip", "netns", "exec", ns, "tc")
        sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "0")
        sh(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", SHAPED, "htb", "rate", rate, "ceil", rate)
        sh(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", direction, f"{SERVER_IP}/32", "flowid", SHAPED)

    def counters(self) -> dict[str, list[int]]:
        """Bytes through the shaped classes so far: 'up' (to S3) and 'down' (from S3), per node."""
        return {"up": [_class_bytes(self.node(i), "eth0") for i in range(self.nodes)],
                "down": [_class_bytes(self.switch, f"n{i}") for i in range(self.nodes)]}

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def teardown(self) -> None:
        """Every process in our namespaces killed (they are this run's), then the namespaces
        deleted, which deletes their veths, bridge and qdiscs. Safe to call twice."""
        for ns in reversed(self.built):
            kill_namespace_processes(ns)
        for ns in reversed(self.built):
            sh("ip", "netns", "del", ns, check=False)
        self.built.clear()


def _class_bytes(ns: str, dev: str) -> int:
    # this iproute2 prints no JSON for htb classes: "class htb 1:10 ...\n Sent N bytes M pkt ..."
    out = sh("ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", dev).stdout
    found = re.search(rf"class htb {SHAPED} .*?\n\s*Sent (\d+) bytes", out)
    if found is None:
        raise RuntimeError(f"no shaped class {SHAPED} on {dev} in {ns}: {out!r}")
    return int(found.group(1))


def kill_namespace_processes(ns: str, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, to each process left in namespace `ns` (only this run's processes
    live there: the namespace is its own)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and sh("ip", "netns", "pids", ns, check=False).stdout.split():
            time.sleep(0.1)

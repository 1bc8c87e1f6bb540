"""The memory tier across nodes: each memory save's copies, and the recovery that reads them.

    save      after a step commits (on the URL or the local tier), every memory_every-th save
              is also committed to each node's memory root (memory_tier.py), on the save's own
              group (the background writer's with async_save, so the training thread never waits
              for it): the ranks exchange their files' names and sizes (rank 0 the manifest and
              marker with them), the free shared memory is checked, then each rank sends its own
              files (rank file, shard file) point to point to the two ranks that write them: the
              lowest rank of its node, which commits the node's copy, and the lowest rank of the
              next node (a ring over the nodes), which commits the partner copy; rank 0 sends the
              replicated file to every other node's lowest rank. Bounded: keep_memory steps per
              area, messages of at most 64 MiB received straight into shared memory.
    recover   at load_latest, before the disk tiers: the ranks agree on the newest step that every
              node holds in its own memory or its partner holds for it (markers compared), the
              partner's lowest rank sends a lost node's files to that node's lowest rank alone
              (checked against the manifest before any is moved into its copy), and the load reads
              every rank's files from its
              own node's memory, with the durable root's leases (fencing as every tier). When no
              step is covered for every rank, or the copy is damaged, the load goes on to the disk
              tiers with a warning naming why.

The exchanges go through the coordinator (object collectives and point-to-point sends on gloo
groups the manager makes), never through a transport of our own. load(state, step=N) recovers
that step the same way where every node holds it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from distckpt.errors import CheckpointFallbackWarning, ConfigError, DistCkptError, warn
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.io.safetensors_format import safetensors_chunks
from distckpt.io.signing import SIGNATURE, Trust
from distckpt.protocol.commit import is_committed, read_marker, step_candidates
from distckpt.protocol.coord import (
    Coordinator,
    Outcome,
    attempt_on_root,
    attempt_phase,
    error_of,
    hostname,
    raise_if_failed,
    run_decided,
    run_phase,
)
from distckpt.protocol.fencing import Lease, read_leases, superseded_by
from distckpt.protocol.memory_tier import OWN, PEER, MemorySettings, NodeMemory, signed_copy, verify_files
from distckpt.protocol.saving import RankReport, check_rank_reports, manifest_bytes
from distckpt.runtime import faults
from distckpt.state import sharded
from distckpt.storage import Storage

log = logging.getLogger("distckpt")

MEMORY, PEER_TIER = "memory", "peer"  # Progress.tier
_SMALL = (mf.MANIFEST, mf.MARKER, SIGNATURE)  # the files that travel with the plan, not point to point


class MemoryTier:
    """A manager's memory tier (every method does nothing when it is off). Collective where it says."""

    def __init__(self, coord: Coordinator, settings: MemorySettings, trust: Trust | None = None) -> None:
        self.settings, self.coord, self.rank = settings, coord, coord.rank
        self.enabled = settings.enabled
        self.memory = NodeMemory(settings, trust) if settings.enabled else None
        self.trust = trust
        mine = [settings.node, hostname(), settings.root, self.memory.claim() if self.memory is not None else None]
        places: list[list[Any]] = [mine] if not settings.enabled or coord.world_size == 1 else \
            coord.all_gather(mine, "init/memory-nodes")
        _check_own_roots(places)
        self.node_of: list[int] = [int(place[0]) for place in places]  # by rank
        self._saves = 0
        self._told_alone = False

    # -- which ranks, which nodes ---------------------------------------------------------

    @property
    def nodes(self) -> list[int]:
        return sorted(set(self.node_of))

    def leader(self, node: int) -> int:
        return self.node_of.index(node)

    def ranks_of(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def partner_of(self, node: int) -> int | None:
        """The node that keeps `node`'s partner copy: the next one in a ring (None: one node)."""
        nodes = self.nodes
        if len(nodes) < 2:
            return None
        return nodes[(nodes.index(node) + 1) % len(nodes)]

    # -- save -----------------------------------------------------------------------------

    def check_save(self, incremental: bool) -> None:
        """The combinations refused by name (at construction)."""
        if self.enabled and incremental:
            raise ConfigError("memory_tier=True with incremental=True is not supported: a memory copy would have "
                              "to carry the files each step references from older ones; use one of the two")

    def next_save(self, must_reach_disk: bool = False) -> tuple[bool, bool]:
        """(to memory, to disk) for the next save, counted alike on every rank: every
        memory_every-th save goes to memory; with disk_every=N a manager's first save and every
        Nth after it go to disk, the others to memory only (a job restarted more often than every
        N saves still reaches disk); `must_reach_disk` (the pre-emption save, agreed on every
        rank) goes to disk."""
        if not self.enabled:
            return False, True
        self._saves += 1
        to_disk = must_reach_disk or (self._saves - 1) % self.settings.disk_every == 0
        return self._saves % self.settings.every == 0, to_disk

    def after_commit(self, coord: Coordinator, step: int, captured: Any, staged: Any, target: Storage,
                     lease: Lease | None) -> None:
        """Commit committed `step` to every node's memory and its partner copies (collective, on the
        save's group). Raises on every rank alike when a node could not (the step stays committed
        where it was saved)."""
        generation = int(captured.infos[0]["generation"] or 0)
        own = self._own_parts(captured, generation)
        mine: dict[str, Any] = {"sizes": [[name, len(data)] for name, data in own.items()]}
        if coord.rank == 0:
            replicated_name, replicated, small = self._root_parts(step, staged, target)
            own[replicated_name] = replicated
            mine["root"] = small  # manifest, marker (and signature): every leader commits them
            mine["replicated"] = [replicated_name, len(replicated)]
            mine["lease"] = dataclasses.asdict(lease) if lease is not None else None
        plan = coord.all_gather(mine, "memory/plan")  # names and sizes only: the bytes go point to point
        self._copy(coord, step, captured, own, plan, generation)

    def commit_memory_only(self, coord: Coordinator, captured: Any, staged: Any, lease: Lease | None,
                           failure: BaseException | None, versions: Callable[[], dict[str, Any]],
                           check_fence: Callable[[Lease], None]) -> None:
        """Commit the captured save to every node's memory and its partner copies, and nowhere
        else (a save between two disk_every saves). Collective, on the save's group. Rank 0 makes
        the manifest, marker (and signature) from every rank's file records as a disk commit
        would, after checking the fence; a rank that failed since the capture (`failure`) fails
        the save on every rank alike, and nothing is written."""
        step, what = captured.step, f"memory save of step {captured.step}"
        generation = int(captured.infos[0]["generation"] or 0)
        digests = self.trust is not None and self.trust.digests
        own = self._own_parts(captured, generation) if failure is None else {}
        write = captured.own_write
        mine: dict[str, Any] = {
            "sizes": [[name, len(data)] for name, data in own.items()],
            "records": {name: _record(data, digests) for name, data in own.items()},
            "shard": [None, None] if write is None or write.shard_tree is None else
                     [sharded.shard_file(captured.rank, generation), write.boxes],
            "outcome": Outcome(self.rank) if failure is None else Outcome.failure(self.rank, failure)}
        if coord.rank == 0 and failure is None:  # after `mine`: the replicated file is no rank's own file
            own[mf.replicated_file(generation)] = b"".join(safetensors_chunks(staged.replicated))

        def decide(views: list[dict[str, Any]]) -> dict[str, Any]:
            failed = [v["outcome"] for v in views if not v["outcome"].ok]
            if failed:
                raise error_of(failed, what)
            assert lease is not None  # rank 0 took it in the capture
            check_fence(lease)  # a superseded writer commits nothing, in memory either
            replicated = mf.replicated_file(generation)
            small = memory_only_root(staged, views, replicated, _record(own[replicated], digests), generation,
                                     versions, self.trust)
            return {"plan": [{"sizes": v["sizes"]} for v in views], "root": small,
                    "replicated": [replicated, len(own[replicated])], "lease": dataclasses.asdict(lease)}

        answer = run_decided(coord, "memory/plan", what, mine, decide)
        plan = answer["plan"]
        plan[0].update(root=answer["root"], replicated=answer["replicated"], lease=answer["lease"])
        self._copy(coord, step, captured, own, plan, generation)

    def _copy(self, coord: Coordinator, step: int, captured: Any, own: dict[str, bytes],
              plan: list[dict[str, Any]], generation: int) -> None:
        """Every rank's files to the ranks that commit them, then each node's copies committed."""
        root = plan[0]
        routes = self._routes(plan)
        receives, keys = self._prepare(coord, step, plan, routes)
        received = self._exchange(coord, step, own, routes, receives, keys)
        faults.point("memory/exchanged", step=step, rank=coord.rank)

        def commit() -> None:
            lease_used = Lease(**root["lease"]) if root.get("lease") else Lease(generation, None, captured.run_id)
            self._commit_node(step, own, root["root"], lease_used, received)

        run_phase(coord, "memory/committed", f"memory copy of step {step}", commit)
        self._tell_if_alone()

    def _routes(self, plan: list[dict[str, Any]]) -> list[tuple[int, int, str, list[tuple[str, int]]]]:
        """Who sends which files to whom, the same list on every rank: (source rank, destination
        rank, area key there, [(name, size)]). Each rank's own files go to its node's leader (unless
        it is the leader) and to its partner node's leader; rank 0's replicated file to every other
        node's leader. Nothing else moves: no rank receives what it does not write."""
        out = []
        for r, view in enumerate(plan):
            node, files = self.node_of[r], [(str(n), int(size)) for n, size in view["sizes"]]
            if self.leader(node) != r:
                out.append((r, self.leader(node), OWN, files))
            partner = self.partner_of(node)
            if partner is not None:
                out.append((r, self.leader(partner), f"{PEER}/node-{node}", files))
        name, size = plan[0]["replicated"]
        for node in self.nodes:
            if node != self.node_of[0]:
                out.append((0, self.leader(node), OWN, [(str(name), int(size))]))
        return out

    def _check_room(self, step: int, plan: list[dict[str, Any]], routes: list[Any]) -> None:
        """The node leader's part, before any byte moves: the node's copy and the partner copies it
        will keep fit in shared memory."""
        assert self.memory is not None
        if self.leader(self.node_of[self.rank]) != self.rank:
            return
        small = sum(len(v) for v in plan[0]["root"].values())
        mine = sum(size for _, size in plan[self.rank]["sizes"])
        if self.rank == 0:
            mine += int(plan[0]["replicated"][1])
        into = {OWN: small + mine}
        for _src, dst, key, files in routes:
            if dst == self.rank:
                into[key] = into.get(key, small) + sum(size for _, size in files)
        self.memory.check_room(into.pop(OWN), sum(into.values()), step)

    def _prepare(self, coord: Coordinator, step: int, plan: list[dict[str, Any]],
                 routes: list[Any]) -> tuple[dict[int, list[Any]], set[str]]:
        """Before any byte moves (collective): the room checked and the files this rank will receive
        made in its node's memory. Raises the same error on every rank if any rank could not, and
        leaves nothing received behind."""
        assert self.memory is not None
        receives: dict[int, list[Any]] = {}
        keys: set[str] = set()

        def prepare() -> None:
            assert self.memory is not None
            self._check_room(step, plan, routes)
            for src, dst, key, files in routes:
                if dst == self.rank:
                    if key not in keys:
                        self.memory.drop_incoming(key, step)
                        keys.add(key)
                    sinks = self.memory.receive_into(key, step, files, fresh=False)
                    receives.setdefault(src, []).extend(sinks[name] for name, _ in files)

        _, exc, outcomes = attempt_phase(coord, "memory/room", prepare)
        if not all(o.ok for o in outcomes):
            self._drop(receives, keys, step)
            raise_if_failed(coord, outcomes, f"memory copy of step {step}", exc)
        return receives, keys

    def _drop(self, receives: dict[int, list[Any]], keys: set[str], step: int) -> None:
        assert self.memory is not None
        _release(receives)
        for key in keys:
            self.memory.drop_incoming(key, step)

    def _exchange(self, coord: Coordinator, step: int, own: dict[str, bytes],
                  routes: list[tuple[int, int, str, list[tuple[str, int]]]], receives: dict[int, list[Any]],
                  keys: set[str]) -> set[str]:
        """This rank's part of the routes (point to point): its files sent, and the files it is sent
        received straight into its node's memory (incoming, committed by _commit_node). Returns
        the area keys it received files for."""
        sends: dict[int, list[Any]] = {}
        for src, dst, _key, files in routes:
            if src == self.rank:
                sends.setdefault(dst, []).extend(own[name] for name, _ in files)
        faults.point("memory/sending", step=step, rank=self.rank)
        try:
            coord.exchange_bytes(sends, receives, f"memory/copies step {step}")
        except BaseException:
            self._drop(receives, keys, step)
            raise
        _release(receives)
        return keys

    def _own_parts(self, captured: Any, generation: int) -> dict[str, bytes]:
        """This rank's own files of the save, by their names in the manifest."""
        out = {mf.rank_file(captured.rank, generation): captured.local.rank_file}
        own = captured.own_write
        if own is not None and own.shard_tree is not None:
            out[sharded.shard_file(captured.rank, generation)] = b"".join(safetensors_chunks(own.shard_tree))
        return out

    def _root_parts(self, step: int, staged: Any, target: Storage) -> tuple[str, bytes, dict[str, bytes]]:
        """Rank 0: the replicated file as written (its name and bytes), and the committed manifest
        and marker (and signature)."""
        base = mf.step_dir(step)
        marker = read_marker(target, step)
        replicated = b"".join(safetensors_chunks(staged.replicated))
        small = {mf.MANIFEST: target.read_bytes(f"{base}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES),
                 mf.MARKER: marker.to_bytes()}
        signature = signed_copy(target, step)  # signing_key: the copies carry the step's signature
        if signature is not None:
            small[SIGNATURE] = signature
        return mf.replicated_file(marker.generation), replicated, small

    def _commit_node(self, step: int, own: dict[str, bytes], small: dict[str, bytes], lease: Lease,
                     received: set[str]) -> None:
        """The node leader's part: its node's copy (the replicated file, manifest and marker, and its
        ranks' own files) and the partner copies it keeps for the node(s) before it in the ring
        (their ranks' own files, manifest and marker), each committed from what it holds and what
        it was sent (room checked before the exchange)."""
        assert self.memory is not None
        node = self.node_of[self.rank]
        if self.leader(node) != self.rank:
            return
        try:
            self.memory.commit(self.memory.own, step, {**small, **own}, lease, self.rank,
                               OWN if OWN in received else None)
            for key in sorted(received - {OWN}):
                self.memory.commit(self.memory.area(key), step, dict(small), lease, self.rank, key)
        finally:  # what a failed commit left received: not kept in shared memory
            for key in received:
                self.memory.drop_incoming(key, step)
        self.memory.prune(self.memory.own)
        for n in self.memory.peer_nodes():
            self.memory.prune(self.memory.peer(n))

    def _tell_if_alone(self) -> None:
        if self.rank == 0 and not self._told_alone and len(self.nodes) < 2:
            self._told_alone = True
            log.warning("rank 0: the memory tier runs on one node: no partner copy is made, so a lost node's "
                        "memory copy is lost with it (its restart loads the disk tiers)")

    # -- recover --------------------------------------------------------------------------

    def recover(self, coord: Coordinator, durable: Storage, load_from: Any, local: Storage | None = None,
                step: int | None = None) -> Any:
        """Load the newest step the memory tier covers for every rank, or `step` where it covers
        that one (collective). Returns the Progress (tier "memory", or "peer" when a node's files
        came from its partner), or None when no memory copy covers every rank, after a warning
        saying why (a `step` the memory tier does not hold: a log line, nothing to warn of): the
        caller loads the disk tiers then. `load_from(storage, step, leases)` reads and applies one
        step's copy, returning the Progress or None when it does not verify."""
        if not self.enabled or self.memory is None:
            return None
        mine = self._holdings()
        if coord.rank == 0:  # the durable root's leases and both disk tiers' step directories: listings only
            try:
                mine["disk"] = {"leases": [dataclasses.asdict(x) for x in read_leases(durable)],
                                "dirs": [] if step is not None else  # a named step: no newer one to look for
                                sorted({s for root in (durable, local) if root is not None
                                        for s in step_candidates(root)})}
            except (OSError, DistCkptError) as e:
                mine["disk"] = {"error": f"{type(e).__name__}: {e}"}
        views = coord.all_gather(mine, "memory/holdings")
        disk = views[0]["disk"]
        if "error" in disk:
            self._fall_back(f"the durable root cannot be read ({disk['error']})")
            return None
        leases = [Lease(**d) for d in disk["leases"]]
        by_node = {self.node_of[r]: v for r, v in enumerate(views) if self.leader(self.node_of[r]) == r}
        candidates, why = _covered(self, by_node, leases)
        if step is not None:
            candidates = [c for c in candidates if c[0] == step]
            if not candidates:
                if coord.rank == 0:
                    log.info("rank 0: step %d is not held in memory for every rank (own or partner copies); loading it "
                             "from the disk tiers", step)
                return None
        else:
            newer = self._newer_on_disk(coord, durable, local, disk["dirs"], candidates, by_node, leases)
            if newer is not None:
                why = (f"the disk tiers hold a newer step ({newer}) than the newest step the memory tier covers "
                       f"for every rank ({candidates[0][0]})")
                candidates = []
        # the newest, and where its copy does not verify the older memory steps above every step
        # directory on disk (memory-only saves, disk_every): never an older memory copy over a disk step
        newest_dir = max(disk["dirs"], default=-1)
        candidates = candidates[:1] + ([c for c in candidates[1:] if c[0] > newest_dir] if step is None else [])
        if not candidates and step is None and not disk["dirs"] and not leases and not any(
                v["own"] or any(v["peers"].values()) for v in by_node.values()):
            if coord.rank == 0:  # a job's first start: nothing anywhere, nothing to warn of
                log.info("rank 0: nothing committed in memory or on disk yet: a fresh start")
            return None
        if not candidates:
            self._fall_back(why)
            return None
        for step, sources in candidates:
            repaired = self._repair(coord, step, sources)
            if not repaired:
                continue
            progress = load_from(self.memory.own, step, leases)
            if progress is not None:
                tier = PEER_TIER if sources else MEMORY
                if coord.rank == 0:
                    log.info("rank 0: resumed step %d from the memory tier (%s)", step,
                             "own copies" if not sources else f"node(s) {sorted(sources)} from their partner")
                return dataclasses.replace(progress, tier=tier)
        self._fall_back(f"the memory copy of step {candidates[0][0]} cannot be used (see the warnings above)")
        return None

    def _newer_on_disk(self, coord: Coordinator, durable: Storage, local: Storage | None, dirs: list[int],
                       candidates: list[tuple[int, dict[int, int]]], by_node: dict[int, dict[str, Any]],
                       leases: list[Lease]) -> int | None:
        """The newest step committed on a disk tier above the memory tier's newest (collective when
        there are step directories above it; None: none). Only the newest memory step may win: an
        older memory copy never wins over a newer step on disk (memory copies are made of committed
        steps, so the disk tiers hold every step the memory tier does). A newer disk step that a
        newer incarnation superseded, as its memory copy's marker tells, does not count: the disk
        load would skip it too."""
        if not candidates:
            return None
        above = [int(d) for d in dirs if int(d) > candidates[0][0] and not _superseded(int(d), by_node, leases)]
        if not above:
            return None

        def committed() -> dict[str, Any]:  # one marker lookup per directory (no payload byte)
            return {"steps": [d for d in above if any(root is not None and is_committed(root, d)
                                                      for root in (durable, local))]}

        outcome, _ = attempt_on_root(coord, "memory/newer-on-disk", committed)
        if not outcome.ok:  # cannot tell: the disk tiers decide
            return max(above)
        return max(outcome.info["steps"], default=None)

    def _holdings(self) -> dict[str, Any]:
        """What this node holds: {step: marker digest} of its own copies and of each partner area."""
        assert self.memory is not None
        memory = self.memory

        def digests(storage: Storage) -> dict[str, str]:
            out = {}
            for step in memory.steps(storage):
                try:
                    m = read_marker(storage, step)
                    out[str(step)] = f"{m.manifest_digest}:{m.generation}:{m.run_id}"
                except (OSError, DistCkptError):
                    continue
            return out

        return {"own": digests(memory.own), "peers": {str(n): digests(memory.peer(n)) for n in memory.peer_nodes()}}

    def _repair(self, coord: Coordinator, step: int, sources: dict[int, int]) -> bool:
        """Nodes without their own copy of `step` get it from their partner (collective): the
        partner's leader reads and verifies its copy and sends it to the lost node's leader alone
        (point to point), which checks every file against the manifest before any is moved into
        its memory, then commits it. False (with a warning) if any failed."""
        if not sources:
            return True
        assert self.memory is not None
        memory = self.memory
        node = self.node_of[self.rank]
        sending = {lost: src for lost, src in sources.items() if src == node and self.leader(node) == self.rank}
        held: dict[int, dict[str, Any]] = {}

        def read() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for lost in sending:
                generation = read_marker(memory.peer(lost), step).generation
                names = [name for r in self.ranks_of(lost)
                         for name in (mf.rank_file(r, generation), sharded.shard_file(r, generation))]
                listed = memory.read_step(memory.own, step, [mf.replicated_file(generation)], copy=False)
                manifest = verify_files(listed, step, f"{memory.own.url}/{mf.step_dir(step)}")
                files = memory.read_step(memory.peer(lost), step, [n for n in names if n in manifest.files], copy=False)
                files[mf.replicated_file(generation)] = listed[mf.replicated_file(generation)]
                held[lost] = {n: v for n, v in files.items() if n not in _SMALL}
                out[str(lost)] = {"small": {n: bytes(v) for n, v in files.items() if n in _SMALL},
                                  "sizes": [[n, len(v)] for n, v in held[lost].items()]}
            return out

        _, _, outcomes = attempt_phase(coord, f"memory/read step {step}", read, info=lambda out: out)
        if not all(o.ok for o in outcomes):
            self._warn_damaged(step, outcomes)
            return False
        plans = {int(lost): (o.rank, plan) for o in outcomes for lost, plan in o.info.items()}
        sends = {self.leader(lost): list(held[lost].values()) for lost in held}
        receives: dict[int, list[Any]] = {}
        sinks: dict[str, Any] = {}
        receiving = node in plans and self.leader(node) == self.rank

        def ready() -> None:  # the files received into, made before any byte moves (agreed)
            if receiving:
                src, plan = plans[node]
                sinks.update(memory.receive_into(OWN, step, [(str(n), int(size)) for n, size in plan["sizes"]]))
                receives[src] = [sinks[str(n)] for n, _ in plan["sizes"]]

        _, _, outcomes = attempt_phase(coord, f"memory/receiving step {step}", ready)
        if not all(o.ok for o in outcomes):
            _release(receives)
            if receiving:
                memory.drop_incoming(OWN, step)
            self._warn_damaged(step, outcomes)
            return False
        try:
            coord.exchange_bytes(sends, receives, f"memory/restore step {step}")
        except BaseException:
            _release(receives)
            memory.drop_incoming(OWN, step)
            raise

        def receive() -> None:
            if not receives:
                return
            try:
                files = {**plans[node][1]["small"], **sinks}
                verify_files(files, step, f"the partner copy of step {step} for node {node}")
            finally:
                _release(receives)
            faults.point("memory/repairing", step=step, rank=self.rank)
            small = plans[node][1]["small"]
            memory.commit(memory.own, step, dict(small), _lease_of(small), self.rank, OWN)

        _, _, outcomes = attempt_phase(coord, f"memory/repaired step {step}", receive)
        if not all(o.ok for o in outcomes):
            memory.drop_incoming(OWN, step)
            self._warn_damaged(step, outcomes)
            return False
        return True

    def _warn_damaged(self, step: int, outcomes: list[Any]) -> None:
        failed = "; ".join(f"rank {o.rank}: {o.error_type}: {o.message}" for o in outcomes if not o.ok)
        warn(f"rank {self.rank}: the memory copy of step {step} cannot be used ({failed}); loading "
             "the disk tiers", CheckpointFallbackWarning)

    def _fall_back(self, why: str) -> None:
        warn(f"rank {self.rank}: not resuming from the memory tier: {why}; loading the disk tiers",
             CheckpointFallbackWarning)


def _covered(tier: MemoryTier, by_node: dict[int, dict[str, Any]],
             leases: list[Lease]) -> tuple[list[tuple[int, dict[int, int]]], str]:
    """The steps every node holds (its own copy, or its partner's with the partner's own copy for the
    replicated file), one marker for all, newest first: [(step, {lost node: source node})]. A step
    a newer incarnation superseded is left out (fencing.py): a zombie's memory copy never wins."""
    steps = sorted({int(s) for v in by_node.values() for s in v["own"]}, reverse=True)
    steps = [s for s in steps if not _superseded(s, by_node, leases)]
    out = []
    uncovered: dict[int, list[int]] = {}
    for step in steps:
        sources: dict[int, int] = {}
        markers: set[str] = set()
        missing = []
        for node in tier.nodes:
            own = by_node[node]["own"].get(str(step))
            if own is not None:
                markers.add(own)
                continue
            partner = tier.partner_of(node)
            if partner is None:
                missing.append(node)
                continue
            held = by_node[partner]["peers"].get(str(node), {}).get(str(step))
            if held is not None and by_node[partner]["own"].get(str(step)) == held:
                markers.add(held)
                sources[node] = partner
            else:
                missing.append(node)
        if missing:
            uncovered[step] = missing
            continue
        if len(markers) == 1:
            out.append((step, sources))
    if out:
        return out, ""
    if not steps and any(held for v in by_node.values() for held in v["peers"].values()):
        return [], ("no node holds its own memory copy of any step: the partner copies left hold the nodes' "
                    "own files, not the replicated file (the model and optimizer), which only own copies keep")
    if not steps:
        return [], "no node holds a committed step in memory"
    step = steps[0]
    ranks = [r for n in uncovered.get(step, []) for r in tier.ranks_of(n)]
    return [], (f"no memory copy covers every rank (step {step}: neither node(s) {uncovered.get(step)} nor their "
                f"partner hold it, so rank(s) {ranks} have no copy; or the nodes' markers differ)")


def _superseded(step: int, by_node: dict[int, dict[str, Any]], leases: list[Lease]) -> bool:
    for view in by_node.values():
        held = view["own"].get(str(step))
        if held is not None and superseded_by(int(held.split(":")[1]), step, leases) is not None:
            return True
    return False


def _lease_of(files: dict[str, bytes]) -> Lease:
    """The lease a repaired copy is committed under: its marker's generation, replacing nothing newer."""
    marker = mf.Marker.parse(files[mf.MARKER], "")
    return Lease(marker.generation, None, marker.run_id)


def _check_own_roots(places: list[list[Any]]) -> None:
    """Every node its own memory root: two nodes on one machine given one DISTCKPT_MEMORY_DIR
    would commit into each other's copies (the same on every rank: the list is every rank's)."""
    problems = [(rank, place[3]) for rank, place in enumerate(places) if place[3]]
    if problems:
        raise ConfigError("memory_tier=True: " + "; ".join(f"rank {rank}: {why}" for rank, why in problems))
    seen: dict[tuple[str, str], int] = {}
    for node, host, root, _ in places:
        other = seen.setdefault((str(host), str(root)), int(node))
        if other != int(node):
            raise ConfigError(f"nodes {other} and {node} (GROUP_RANK) on host {host} share the memory root {root}: "
                              "each node needs its own; give each torchrun agent its own DISTCKPT_MEMORY_DIR, or "
                              "leave it unset (the default is one per job and node in /dev/shm)")


def _record(data: bytes, digest: bool) -> dict[str, Any]:
    """A file's manifest record (size and xxh3; with signing its BLAKE3 too), as a write makes it."""
    check = mf.Checksum(digest=digest)
    for _ in check.wrap([data]):
        pass
    return check.record()


def memory_only_root(staged: Any, views: list[dict[str, Any]], replicated: str, replicated_record: dict[str, Any],
                     generation: int, versions: Callable[[], dict[str, Any]], trust: Trust | None) -> dict[str, bytes]:
    """Rank 0: the manifest, marker (and signature) of a step committed to memory only, listing
    the replicated file and every rank's own files as their ranks recorded them."""
    where = f"memory tier, step {staged.step}"
    reports = [RankReport(r, dict(v["records"]), v["shard"][0], v["shard"][1]) for r, v in enumerate(views)]
    table = check_rank_reports(staged, reports, generation, where)
    files = {replicated: replicated_record, **{n: rec for r in reports for n, rec in r.files.items()}}
    manifest = manifest_bytes(staged, staged.replicated, files, table, generation, versions)
    small = {mf.MANIFEST: manifest,
             mf.MARKER: mf.Marker(staged.step, mf.checksum_of(manifest), staged.run_id, generation).to_bytes()}
    if trust is not None and trust.signer is not None:
        small[SIGNATURE] = signing.signature_bytes(trust.signer, manifest)
    return small


def _release(receives: dict[int, list[Any]]) -> None:
    """Unmap the files received into (their bytes stay in the files)."""
    for sinks in receives.values():
        for sink in sinks:
            if hasattr(sink, "close"):
                try:
                    sink.close()
                except BufferError:  # a view of it not yet freed (a gloo thread lets go of its
                    pass             # request a moment after the wait): unmapped with the last view


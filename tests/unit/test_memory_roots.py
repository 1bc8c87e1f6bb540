"""Each node its own memory root: two nodes on one host sharing one are refused by name."""

import pytest

from distckpt.errors import ConfigError
from distckpt.protocol.memory_copies import _check_own_roots


def test_two_nodes_on_one_host_with_one_root_are_refused():
    with pytest.raises(ConfigError, match="nodes 0 and 1 .* on host h share the memory root /dev/shm/x"):
        _check_own_roots([[0, "h", "/dev/shm/x", None], [0, "h", "/dev/shm/x", None], [1, "h", "/dev/shm/x", None]])


@pytest.mark.parametrize("places", [
    [[0, "h", "/r", None], [0, "h", "/r", None]],  # two ranks of one node: one root, as it should be
    [[0, "a", "/r", None], [1, "b", "/r", None]],  # the same path on two machines: two roots
    [[0, "h", "/r0", None], [1, "h", "/r1", None]],  # two agents on one machine, each its own
])
def test_a_root_per_node_is_accepted(places):
    _check_own_roots(places)


class _TwoNodes:
    """Two nodes of one rank each, partners of each other (as MemoryTier has them)."""

    nodes = [0, 1]

    def partner_of(self, node):
        return 1 - node

    def ranks_of(self, node):
        return [node]


def test_only_partner_copies_left_says_the_replicated_file_is_what_is_missing():
    from distckpt.protocol.memory_copies import _covered

    by_node = {0: {"own": {}, "peers": {"1": {"4": "d:1:run"}}}, 1: {"own": {}, "peers": {"0": {"4": "d:1:run"}}}}
    assert _covered(_TwoNodes(), by_node, []) == ([], (
        "no node holds its own memory copy of any step: the partner copies left hold the nodes' own files, not the "
        "replicated file (the model and optimizer), which only own copies keep"))
    empty = {0: {"own": {}, "peers": {}}, 1: {"own": {}, "peers": {"0": {}}}}
    assert _covered(_TwoNodes(), empty, [])[1] == "no node holds a committed step in memory"

"""Which node each member of a group is on (spec 9.8): the one place the nodes are derived.

A node-scoped save's plan and the manager's peer copies both need the job's nodes in the same order,
each member's node and each node's leader; deriving them in each would let the two drift apart.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from ckptfmt.groups.ranks import Ranks


@dataclass(frozen=True)
class NodeLayout:
    """The nodes of a group's members (by position), from each member's host: the hosts in the order of
    their first member (node 0 is the coordinator's), each member's node, and each node's leader (its
    first member)."""

    hosts: tuple[str, ...]
    node_of: tuple[int, ...]
    leaders: tuple[int, ...]

    @classmethod
    def of(cls, member_hosts: Sequence[str]) -> NodeLayout:
        """The layout of members on ``member_hosts`` (one host per position)."""
        numbers: dict[str, int] = {}
        leaders: list[int] = []
        node_of = []
        for position, host in enumerate(member_hosts):
            if host not in numbers:
                numbers[host] = len(numbers)
                leaders.append(position)
            node_of.append(numbers[host])
        return cls(tuple(numbers), tuple(node_of), tuple(leaders))

    @classmethod
    def gather(cls, ranks: Ranks) -> NodeLayout:
        """The layout of ``ranks``, on every member: each one's host gathered, then broadcast (collective)."""
        return cls.of(ranks.broadcast(ranks.gather(socket.gethostname())))

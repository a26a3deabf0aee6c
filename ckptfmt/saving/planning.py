"""The coordinator's plan (step 1 of the save protocol, spec 11.7): one state and one tensor table from
every member's encoding, and one writer for each box of tensor data.

A member's ``RankPlan`` is its encoded value tree and its ``PlannedTensor`` entries. The coordinator
merges the value trees (``state_merge``), checks that the members agree on every tensor's dtype and
shape, groups the boxes they hold (a replicated tensor's box is held by several; a sharded one's by its
owner), compares replicas' fingerprints (``replicas``), and gives each box one writer, balancing
bytes. A save by one process is the same plan with one member: its tree is kept as it was encoded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptfmt._collector import collector_paused
from ckptfmt.errors import CheckpointError
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.values import TensorRef, decode_tree, encode_tree
from ckptfmt.groups.nodes import NodeLayout
from ckptfmt.repository.leases import Lease
from ckptfmt.repository.repository import Repository
from ckptfmt.saving import replicas
from ckptfmt.saving.opening import open_for_save, refuse_taken_name, resolve_parent
from ckptfmt.saving.options import SaveOptions
from ckptfmt.saving.plan import PlannedTensor
from ckptfmt.saving.state_merge import merge_states


@dataclass
class RankPlan:
    """What a member sends the coordinator: its encoded state, its tensors, each source's box shape and
    size, the device meshes of its DTensors, and its sources' fingerprints (None: not compared)."""

    state: bytes
    entries: list[PlannedTensor]
    shapes: list[tuple[int, ...]]
    nbytes: list[int]
    meshes: list[dict]
    fingerprints: list[bytes] | None
    #: The member's host: its node, for a node-scoped repository.
    host: str = ""


@dataclass(slots=True)
class Box:
    """One box of a tensor's data, the members holding it (position, source index), their fingerprints
    of it (none when not compared), its owner if the state named one, and the member writing it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    holders: list[tuple[int, int]]
    owner: int | None = None
    prints: list[bytes] | tuple[()] = ()  # a list once there is one (most boxes have none)
    writer: tuple[int, int] = (-1, -1)  # (position, index in that member's assigned sources)

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The holders grouped by equal bytes, the majority first (one group when not compared)."""
        if len(self.prints) != len(self.holders):
            return (tuple(position for position, _ in self.holders),)
        return replicas.agreeing_groups([(position, p) for (position, _), p in zip(self.holders, self.prints)])


@dataclass(slots=True)
class MergedTensor:
    """A tensor of the checkpoint: its facts, ``same_as`` (the index of the tensor it is another name
    of) and, unless it is one, the boxes of its data."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    requires_grad: bool
    same_as: int | None
    boxes: list[Box] = field(default_factory=list)


@dataclass
class Plan:
    """What the coordinator decided: the value tree, the tensors, who writes what."""

    repo: Repository | None  # the coordinator's; other members open their own
    lease: Lease | None  # the coordinator's save lease (spec 11.6)
    parent_name: str | None
    parent_keys: set[str]
    state: bytes
    user: bytes
    tensors: list[MergedTensor]
    #: Per member, the indices of its sources it writes.
    assigned: list[list[int]]
    meshes: list[dict]
    differences: list[str]
    #: Replicated boxes whose holders' bytes differ (spec 9.7), and how many shared boxes were compared.
    divergences: list[replicas.Divergence] = field(default_factory=list)
    replicas_checked: int = 0
    #: The parent's manifest, on the coordinator (the others read it when they need it).
    parent: Manifest | None = None
    #: A node-scoped repository's nodes and each member's (None for a job-scoped one).
    nodes: NodeLayout | None = None
    #: Per member, where in its sources a new sequence starts (packs do not cross it): node scope only.
    breaks: list[list[int]] = field(default_factory=list)

    def __getstate__(self) -> dict:  # what the broadcast sends: nothing of the coordinator's own
        return {**self.__dict__, "repo": None, "lease": None, "parent": None}


def decide(plans: list[RankPlan], rank_of, repo_url: str, name: str, options: SaveOptions) -> Plan:
    """The coordinator's plan, made under the save lease it holds until the outcome (released on failure).
    ``rank_of``: the rank recorded for a member's position (``Ranks.rank_of``)."""
    repo, lease = open_for_save(repo_url, options)
    try:
        with collector_paused():  # a record per tensor and per box: no cycles to find
            return _plan(plans, rank_of, repo, lease, name, options)
    except BaseException:
        lease.release()
        raise


def _plan(plans: list[RankPlan], rank_of, repo: Repository, lease: Lease, name: str, options: SaveOptions) -> Plan:
    refuse_taken_name(repo, name)
    parent_name, parent_keys, parent = resolve_parent(repo, options.parent)
    differences: list[str] = []
    if len(plans) == 1:  # one member: its tree as encoded, tensors numbered as it met them
        state = plans[0].state
        order = [entry.key for entry in plans[0].entries]
    else:
        trees = []
        for position, plan in enumerate(plans):
            keys = [entry.key for entry in plan.entries]
            trees.append((rank_of(position), decode_tree(plan.state, functools.partial(_ref, keys))))
        merged, differences = merge_states(trees)
        numbers: dict[str, int] = {}
        state = encode_tree(merged, lambda path, ref: numbers.setdefault(ref.key, len(numbers)))
        order = list(numbers)
    tensors = _tensors(plans, order, rank_of)
    assigned = _assign(tensors, len(plans))
    nodes: NodeLayout | None = None
    breaks: list[list[int]] = []
    if options.node_scoped:
        nodes = NodeLayout.of([plan.host for plan in plans])
        assigned, breaks = _node_sequences(tensors, assigned, nodes.node_of)
    meshes = [mesh for plan in plans for mesh in plan.meshes]
    user = encode_tree({} if options.metadata is None else options.metadata)
    shared = [(tensor, box) for tensor in tensors for box in tensor.boxes if len(box.holders) > 1 and box.prints]
    divergences = [replicas.Divergence(tensor.key, box.offsets, box.shape,
                                       tuple(tuple(map(rank_of, group)) for group in groups))
                   for tensor, box in shared if len(groups := box.groups()) > 1]
    return Plan(repo, lease, parent_name, parent_keys, state, user, tensors, assigned,
                [m for i, m in enumerate(meshes) if m not in meshes[:i]], differences, divergences, len(shared),
                parent, nodes, breaks)


def _ref(keys: list[str], index: int) -> TensorRef:
    """The key of a member's tensor ``index``, as the merged value tree's leaf."""
    return TensorRef(keys[index])


def _tensors(plans: list[RankPlan], order: list[str], rank_of) -> list[MergedTensor]:
    """The tensor table in state order: each key's dtype and shape (members must agree) and data boxes."""
    holding: dict[str, list[tuple[int, PlannedTensor]]] = {}
    for position, plan in enumerate(plans):
        for entry in plan.entries:
            holding.setdefault(entry.key, []).append((position, entry))
    disagreements = []
    for key in order:
        holders = holding[key]
        if len(holders) == 1:
            continue
        first_position, first = holders[0]
        for position, entry in holders[1:]:
            if (entry.dtype, tuple(entry.shape)) != (first.dtype, tuple(first.shape)):
                disagreements.append(f"{key!r} is {first.dtype} {list(first.shape)} on rank {rank_of(first_position)}, "
                                     f"{entry.dtype} {list(entry.shape)} on rank {rank_of(position)}")
                break
    if disagreements:
        raise CheckpointError(f"ranks disagree on {len(disagreements)} tensor(s): " + "; ".join(disagreements[:8]))

    def data_key(key: str) -> str:
        """The key whose boxes hold this tensor's data: an alias (same_as) on its first member points elsewhere."""
        position, entry = holding[key][0]
        return key if entry.same_as is None else plans[position].entries[entry.same_as].key

    tensors: list[MergedTensor] = []
    primary: dict[str, int] = {}
    for key in order:
        _, entry = holding[key][0]
        source_key = data_key(key)
        alias_of = primary.get(source_key)
        tensor = MergedTensor(key, entry.dtype, tuple(entry.shape), entry.kind, entry.requires_grad, alias_of)
        if alias_of is None:
            primary[source_key] = len(tensors)
            tensor.boxes = _boxes(plans, holding[source_key], key)
        tensors.append(tensor)
    return tensors


def _boxes(plans: list[RankPlan], holders: list[tuple[int, PlannedTensor]], key: str) -> list[Box]:
    boxes: dict[tuple[int, ...], Box] = {}
    for position, entry in holders:
        if entry.same_as is not None:
            continue
        plan = plans[position]
        for held in entry.boxes:
            offsets, shape = tuple(held.offsets), tuple(plan.shapes[held.source])
            box = boxes.get(offsets)
            if box is None:
                box = boxes[offsets] = Box(offsets, shape, plan.nbytes[held.source], [], held.owner)
            elif box.shape != shape:
                raise CheckpointError(f"tensor {key!r}: ranks hold boxes at offsets {list(offsets)} of different "
                                      f"shapes ({list(box.shape)} and {list(shape)})")
            box.holders.append((position, held.source))
            if plan.fingerprints is not None:
                if not box.prints:
                    box.prints = []
                box.prints.append(plan.fingerprints[held.source])
    return [boxes[offsets] for offsets in sorted(boxes)] if len(boxes) > 1 else list(boxes.values())


def _assign(tensors: list[MergedTensor], members: int) -> list[list[int]]:
    """One writer per box: boxes only one member holds go to it; shared ones, largest first, to the least
    loaded."""
    load = [0] * members
    assigned: list[list[int]] = [[] for _ in range(members)]
    boxes = [box for tensor in tensors for box in tensor.boxes]

    def give(box: Box, position: int, source: int) -> None:
        box.writer = (position, len(assigned[position]))
        assigned[position].append(source)
        load[position] += box.nbytes
    for box in sorted((b for b in boxes if len(b.holders) == 1), key=lambda b: b.holders[0]):
        give(box, *box.holders[0])  # each member writes its own in the order it met them
    for box in sorted((b for b in boxes if len(b.holders) > 1), key=lambda b: -b.nbytes):
        majority = set(box.groups()[0])  # the holders whose copies agree with most others'
        position, source = min((h for h in box.holders if h[0] in majority), key=lambda h: (load[h[0]], h[0]))
        give(box, position, source)
    return assigned




def _node_sequences(tensors: list[MergedTensor], assigned: list[list[int]], node_of: Sequence[int]
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """For a node-scoped repository: every node whose members hold a box stores it too, in chunks of the
    same names as its writer's. Each writer's boxes are cut into sequences by the members of the other
    nodes that will write them again (the lowest member of each such node holding the box); each of those
    members writes the sequence after its own boxes, in the same order, and each sequence starts a new
    pack of small tensors (``store_sources``' ``breaks``), so that packs come out byte for byte the same.
    Returns each member's sources in writing order (``box.writer`` renumbered) and where its sequences
    start."""
    own: list[list[Box]] = [[] for _ in assigned]
    for box in sorted((b for tensor in tensors for b in tensor.boxes), key=lambda b: b.writer):
        own[box.writer[0]].append(box)
    order: list[list[int]] = [[] for _ in assigned]
    breaks: list[list[int]] = [[] for _ in assigned]
    again: list[list[list[int]]] = [[] for _ in assigned]
    for position, boxes in enumerate(own):
        groups: dict[tuple, list[Box]] = {}
        for box in boxes:
            others: dict[int, int] = {}
            majority = set(box.groups()[0])  # the stored copy's bytes: a rank out of sync has others
            for holder, _ in box.holders:
                node = node_of[holder]
                if node != node_of[position] and holder in majority:
                    others[node] = min(others.get(node, holder), holder)
            groups.setdefault(tuple(sorted(others.items())), []).append(box)
        for key, group in groups.items():
            breaks[position].append(len(order[position]))
            for box in group:
                box.writer = (position, len(order[position]))
                order[position].append(dict(box.holders)[position])
            for _, member in key:
                again[member].append([dict(box.holders)[member] for box in group])
    for member, sequences in enumerate(again):
        for sequence in sequences:
            breaks[member].append(len(order[member]))
            order[member].extend(sequence)
    return order, breaks

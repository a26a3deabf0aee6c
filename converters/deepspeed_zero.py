"""DeepSpeed ZeRO partitions to whole parameters: views of the ranks' mapped flat partitions.

The layout (as ``deepspeed.utils.zero_to_fp32`` reads it): stage 1/2: each optimizer group's
partitions, concatenated over the data-parallel ranks, are the group's parameters back to back
(plus ``param_alignment_paddings``), the fp32 partitions saved without their padding; stage 3:
each parameter is split in ``ceil(numel / world)`` pieces, one per rank, the last padded, a
rank's pieces back to back in its ``fp32_flat_groups`` (one per sub-group). ``Rebuild`` reads
one model-parallel rank's optimizer files one data-parallel rank at a time and gives each
parameter's fp32 master weight and per-element optimizer state as a view of the partitions
(``_join``): whole when inside one partition, a ``ckptfmt.Sharded`` of row ranges when split
(a row cut by a split copied as a shard of its own, a split 1-d parameter copied).
``deepspeed_export`` writes the same layout back for any world size.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Any

import torch

from ckptfmt.converters.pickles import Node, PickleError, restricted_loads
from ckptfmt.errors import CheckpointError
from ckptfmt.format.values import OpaqueObject
from ckptfmt.tensors.sharded import Shard, Sharded

#: Keys of a ZeRO optimizer state dict that are per-rank layout, not state (rebuilt or dropped).
_LAYOUT_KEYS = {"base_optimizer_state", "optimizer_state_dict", "single_partition_of_fp32_groups",
                "fp32_flat_groups", "param_slice_mappings", "zero_stage", "ds_version"}


def _tensor(value: Any, where: str) -> torch.Tensor:
    """``value``, checked to be a tensor."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where}: expected a tensor, found {type(value).__name__}")
    return value


def _numel(shape: Any, where: str) -> int:
    if not isinstance(shape, (torch.Size, tuple, list)) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: malformed parameter shape {shape!r}")
    return math.prod(shape)


class Rebuild:
    """Each parameter's fp32 weight and optimizer state as views of the ranks' mapped flat partitions.

    The ranks' files are read one at a time; each parameter's pieces in them are noted as
    views (never copied), then joined per parameter by ``_join``.
    """

    def __init__(self, folder, main, model, dp, mp, optims, zero3_models, opaque, notes, read_file):
        self.folder, self.model, self.dp, self.read_file = folder, model, dp, read_file
        self.mp, self.mp_size = mp, model.get("mp_world_size", 1)
        self.optims, self.zero3_models = optims, zero3_models
        self.opaque, self.notes = opaque, notes
        self.fp32: OrderedDict[str, torch.Tensor | Sharded] = OrderedDict()
        self.moments: dict[str, dict] = {}
        self.param_groups: list = []
        self.extras: dict = {}
        self.main = os.path.join(folder, main)
        shapes = model.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise CheckpointError(f"{self.main}: param_shapes is not a list of name -> shape per group")
        self.groups = [[(str(n), tuple(s), _numel(s, f"{self.main}: param_shapes[{n!r}]")) for n, s in g.items()]
                       for g in shapes]

    def run(self) -> int:
        model = self.model
        module = model["module"]
        buffer_names = model.get("buffer_names") or []
        for name, value in module.items():  # buffers first, as floats (zero_to_fp32's order and types)
            if name in buffer_names and isinstance(value, torch.Tensor):
                self.fp32[name] = value.float() if value.is_floating_point() else value
        stage = None
        for rank in range(self.dp):
            name = self.optims[rank]
            where = os.path.join(self.folder, name)
            sd = self.read_file(name)
            osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
            if not isinstance(osd, dict):
                raise CheckpointError(f"{where}: no optimizer_state_dict: not a ZeRO optimizer file")
            rank_stage = self._stage(osd, where)
            if stage is None:
                stage = rank_stage
                self._start(stage, osd, sd, where)
            elif rank_stage != stage:
                raise CheckpointError(f"{where}: ZeRO stage {rank_stage}, rank 0 says {stage}")
            if stage == 3:
                self._rank3(rank, osd, where)
                if self.frozen:
                    rank_model = model if rank == 0 else self.read_file(self.zero3_models[rank])
                    self._frozen3(rank, rank_model.get("frozen_param_fragments") or {})
                    del rank_model
            else:
                self._rank12(rank, osd, where)
            del sd, osd
        self._finish(stage)
        return stage

    def _owner(self, rank: int) -> int:
        """A shard's owning rank: data-parallel rank ``rank`` of this model-parallel rank (Megatron's order)."""
        return rank * self.mp_size + self.mp

    def _add(self, key: str, name: str, start: int, flat: torch.Tensor, rank: int) -> None:
        """Note ``flat`` (a view) as elements [start, start + len) of parameter ``name``'s ``key``."""
        self.pieces.setdefault((key, name), []).append((start, flat, self._owner(rank)))
        self.dtypes.setdefault(key, flat.dtype)
        if key:
            self.elem_keys.setdefault(key)

    def _stage(self, osd: dict, where: str) -> int:
        value = osd.get("zero_stage")
        if isinstance(value, OpaqueObject):
            try:
                node = restricted_loads(value.pickle)
            except PickleError:
                node = None
            if isinstance(node, Node) and node.name[1] == "ZeroStageEnum" and len(node.args) == 1:
                value = node.args[0]
        if type(value) is int and value in (1, 2, 3):
            return value
        if value is None and "fp32_flat_groups" not in osd and "single_partition_of_fp32_groups" in osd:
            # BF16_Optimizer (bf16, ZeRO-1, fp32 gradient accumulation) records no stage; its partitions
            # keep their padding (at the end of the last rank's), which the layout below ignores
            if where.endswith(f"{os.sep}bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
                self.notes.append("bf16_zero_* files of DeepSpeed's BF16_Optimizer: read as ZeRO stage 1")
            return 1
        raise CheckpointError(f"{where}: unknown ZeRO stage {value!r}")

    def _start(self, stage: int, osd: dict, sd: dict, where: str) -> None:
        """Allocate whole tensors from rank 0's file (dtypes, per-element state keys) and record extras."""
        self.stage = stage
        self.extras = {k: v for k, v in osd.items() if k not in _LAYOUT_KEYS}
        self.extras["zero_stage"] = stage
        for key, value in self.extras.items():
            if isinstance(value, OpaqueObject):
                self.opaque.append(f"zero_optimizer/{key}")
        frozen = self.model.get("frozen_param_shapes") or {}
        self.frozen = [(str(n), tuple(s), _numel(s, f"{self.main}: frozen_param_shapes[{n!r}]"))
                       for n, s in frozen.items()]
        if stage == 3:
            self.frozen = [f[0] for f in self.frozen]
            self._frozen_shapes = {n: tuple(s) for n, s in frozen.items()}
        base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
        if isinstance(base, dict) and isinstance(base.get("state"), dict):
            self.base_states = lambda b: b["state"]
            groups = base.get("param_groups")
        elif isinstance(base, list):  # elastic checkpoint: one lean state per group
            self.base_states = lambda b: dict(enumerate(b))
            groups = None
            self.notes.append("elastic ZeRO checkpoint: it records no optimizer param_groups (lr, betas, ...)")
        else:
            raise CheckpointError(f"{where}: no base optimizer state")
        self.param_groups = []
        if isinstance(groups, list) and (stage == 3 or len(groups) == len(self.groups)):
            for i, group in enumerate(groups):
                group = dict(group)
                # stage 3: param_shapes is per sub-group, and a group's "params" are its sub-groups' indices
                members = group.get("params") if stage == 3 else [i]
                if not isinstance(members, list) or \
                        not all(type(m) is int and 0 <= m < len(self.groups) for m in members):
                    raise CheckpointError(f"{where}: param_groups[{i}] names sub-groups {members!r}, "
                                          f"param_shapes has {len(self.groups)}")
                group["params"] = [n for m in members for n, _, _ in self.groups[m]]
                self.param_groups.append(group)
        # (key, name) -> [(start, flat view, owning rank)]: key "" is the fp32 weight, else a moment
        self.pieces: dict[tuple[str, str], list] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.elem_keys: dict[str, None] = {}   # per-element state keys, in the files' order
        self.group_scalars: dict[int, dict] = {}
        if stage != 3:
            step = osd.get("base_optimizer_state_step")
            if step is not None:
                self.group_scalars[-1] = {"step": step}

    # ---------------------------------------------------------------- stage 1/2

    def _rank12(self, rank: int, osd: dict, where: str) -> None:
        parts = osd.get("single_partition_of_fp32_groups")
        if not isinstance(parts, list) or len(parts) != len(self.groups):
            raise CheckpointError(f"{where}: single_partition_of_fp32_groups does not hold "
                                  f"{len(self.groups)} group(s)")
        paddings = osd.get("param_alignment_paddings")
        if rank == 0:
            self.offsets = [0] * len(self.groups)   # where each group's next partition starts
            self.layout = []
            for g, params in enumerate(self.groups):
                pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
                if pads is not None and (not isinstance(pads, list) or len(pads) != len(params)):
                    raise CheckpointError(f"{where}: param_alignment_paddings[{g}] does not match the group's "
                                          f"{len(params)} parameters")
                spans, offset = [], 0
                for i, (_, _, numel) in enumerate(params):
                    spans.append(offset)
                    offset += numel + (pads[i] if pads is not None else 0)
                self.layout.append((spans, offset))
        base = self.base_states(osd.get("base_optimizer_state"))
        for g, params in enumerate(self.groups):
            part = _tensor(parts[g], f"{where}: single_partition_of_fp32_groups[{g}]").reshape(-1)
            start, length = self.offsets[g], part.numel()
            gstate = base.get(g, {}) if isinstance(base, dict) else {}
            self._scatter(params, self.layout[g][0], start, length, {"": part}, gstate, g, rank)
            self.offsets[g] += length

    def _scatter(self, params, spans, start, length, master, gstate, g, rank):
        """Note rank ``rank``'s flat range [start, start+length) of group g in each parameter it overlaps."""
        elem = {}
        for key, value in (gstate or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= length and key != "step":
                elem[key] = value.reshape(-1)[:length]
            elif g not in self.group_scalars or key not in self.group_scalars[g]:
                self.group_scalars.setdefault(g, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for key, flat in list(master.items()) + list(elem.items()):
            for (name, _, numel), begin in zip(params, spans):
                lo, hi = max(begin, start), min(begin + numel, start + length)
                if lo < hi:
                    self._add(key, name, lo - begin, flat[lo - start:hi - start], rank)

    # ---------------------------------------------------------------- stage 3

    def _rank3(self, rank: int, osd: dict, where: str) -> None:
        flats = osd.get("fp32_flat_groups")
        if not isinstance(flats, list) or not flats:
            raise CheckpointError(f"{where}: no fp32_flat_groups")
        flats = [_tensor(t, f"{where}: fp32_flat_groups[{i}]").reshape(-1) for i, t in enumerate(flats)]
        base = self.base_states(osd.get("optimizer_state_dict"))
        elem: dict[str, list] = {}
        for i, flat in enumerate(flats):
            gstate = base.get(i, {}) if isinstance(base, dict) else {}
            for key, value in gstate.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and key != "step" \
                        and value.numel() == flat.numel():
                    elem.setdefault(key, []).append(value.reshape(-1))
                elif i not in self.group_scalars or key not in self.group_scalars[i]:
                    self.group_scalars.setdefault(i, {})[key] = \
                        value.clone() if isinstance(value, torch.Tensor) else value
        # the rank's groups back to back, never concatenated (no copy of the rank's partition)
        sources = {"": flats}
        sources.update({k: v for k, v in elem.items() if len(v) == len(flats)})
        starts = [0]
        for flat in flats:
            starts.append(starts[-1] + flat.numel())
        params = [p for g in self.groups for p in g]
        offset = 0
        for name, _, numel in params:
            piece = math.ceil(numel / self.dp)
            lo = rank * piece
            take = max(0, min(piece, numel - lo))
            if offset + take > starts[-1]:
                raise CheckpointError(f"{where}: the flat partitions hold {starts[-1]} elements, "
                                      f"parameter {name!r} needs {offset + take}")
            for key, parts in sources.items():
                for i, part in enumerate(parts):  # the groups [offset, offset + take) falls in
                    a, b = max(offset, starts[i]), min(offset + take, starts[i + 1])
                    if a < b:
                        self._add(key, name, lo + a - offset, part[a - starts[i]:b - starts[i]], rank)
            offset += piece
        if offset != starts[-1]:
            raise CheckpointError(f"{where}: consumed {offset} of the partitions' {starts[-1]} elements: "
                                  "param_shapes do not match the optimizer partitions")

    # ---------------------------------------------------------------- assembly

    def _frozen3(self, rank: int, fragments: dict) -> None:
        """Note stage-3 rank ``rank``'s piece of each frozen parameter (its valid prefix: the last is padded)."""
        where = os.path.join(self.folder, self.zero3_models[rank])
        for name in self.frozen:
            if name not in fragments:
                raise CheckpointError(f"{where}: no frozen fragment of {name!r}")
            flat = _tensor(fragments[name], where).reshape(-1)
            start = sum(piece.numel() for _, piece, _ in self.pieces.get(("", name), []))
            take = max(0, min(flat.numel(), math.prod(self._frozen_shapes[name]) - start))
            if take:
                self._add("", name, start, flat[:take], rank)

    # ---------------------------------------------------------------- assembly

    def _finish(self, stage: int) -> None:
        if stage != 3:
            align = 2 * self.dp
            for g, (_spans, end) in enumerate(self.layout):
                if align * math.ceil(end / align) != align * math.ceil(self.offsets[g] / align):
                    raise CheckpointError(f"{self.folder}: group {g}: the parameters need {end} elements, the "
                                          f"partitions hold {self.offsets[g]}: param_shapes do not match")
        params = [p for g in self.groups for p in g]
        for name, shape, _ in params:
            for key in [""] + sorted(self.elem_keys):
                self._check_covered(key, name, shape)
        # zero_to_fp32's order: buffers, frozen parameters, trainable parameters, shared parameters
        if stage == 3:
            for name in self.frozen:
                self._check_covered("", name, self._frozen_shapes[name])
                self.fp32[name] = self._value("", name, self._frozen_shapes[name])
        else:
            fragments = self.model.get("frozen_param_fragments") or {}
            for name, _shape, _ in self.frozen:
                if name not in fragments:
                    raise CheckpointError(f"{self.main}: no frozen fragment of {name!r}")
                self.fp32[name] = _tensor(fragments[name], f"{self.main}: frozen_param_fragments")
        for name, shape, _ in params:
            self.fp32[name] = self._value("", name, shape)
        for alias, target in (self.model.get("shared_params") or {}).items():
            if target in self.fp32:
                self.fp32[alias] = self.fp32[target]
        group_of = {}
        for g, group in enumerate(self.groups):
            for name, _, _ in group:
                group_of[name] = g
        for name, shape, _ in params:
            moments = self.moments[name] = {key: self._value(key, name, shape) for key in self.elem_keys}
            scalars = self.group_scalars.get(group_of[name], {})
            scalars = {**scalars, **self.group_scalars.get(-1, {})}
            for key, value in scalars.items():
                moments[key] = value.clone() if isinstance(value, torch.Tensor) else value

    def _check_covered(self, key: str, name: str, shape: tuple) -> None:
        got = sum(flat.numel() for _, flat, _ in self.pieces.get((key, name), []))
        if got != math.prod(shape):
            raise CheckpointError(f"{self.folder}: {name!r}{' ' + key if key else ''}: the partitions "
                                  f"cover {got} of {math.prod(shape)} elements")

    def _value(self, key: str, name: str, shape: tuple) -> torch.Tensor | Sharded:
        """Parameter ``name``'s ``key`` ("": fp32 weight) from its pieces, which are then let go."""
        return _join(shape, self.pieces.pop((key, name), []), self.dtypes.get(key, torch.float32))


def _join(shape: tuple, pieces: list, dtype: torch.dtype) -> torch.Tensor | Sharded:
    """A tensor from its flat pieces [(start, view, owning rank)], in order, which cover it exactly.

    Copies as little as the pieces allow, so an import holds one rank's files (mapped) plus
    small copies: one piece is that view, reshaped; a split tensor of 2+ dimensions is a
    ``Sharded`` of row ranges, each a view of its rank's partition, a row that a split cuts
    copied as a shard of its own; other split tensors (1-d: biases, norms) are copied whole.
    """
    if len(pieces) == 1:
        return pieces[0][1].view(shape)
    if not pieces:  # no elements
        return torch.empty(shape, dtype=dtype)
    if len(shape) < 2:
        return torch.cat([flat for _, flat, _ in pieces]).view(shape)
    row = math.prod(shape[1:])
    shards = [_cut_row(pieces, r, row, shape) for r in sorted({s // row for s, _, _ in pieces[1:] if s % row})]
    for start, flat, rank in pieces:
        first, end = -(-start // row), (start + flat.numel()) // row
        if first < end:
            view = flat[first * row - start:end * row - start].view((end - first, *shape[1:]))
            shards.append(Shard((first,) + (0,) * (len(shape) - 1), view, rank))
    return Sharded(shape, sorted(shards, key=lambda shard: shard.offsets))


def _cut_row(pieces: list, r: int, row: int, shape: tuple) -> Shard:
    """Row ``r``, which a split cuts, copied from the pieces holding it; owned by its first element's rank."""
    lo, hi = r * row, (r + 1) * row
    held = [(start, flat, rank) for start, flat, rank in pieces if start < hi and start + flat.numel() > lo]
    data = torch.cat([flat[max(lo - start, 0):hi - start] for start, flat, _ in held])
    return Shard((r,) + (0,) * (len(shape) - 1), data.view((1, *shape[1:])), held[0][2])

"""Read DeepSpeed checkpoint folders (ZeRO stages 0-3, fp32 or bf16, tensor parallel) without DeepSpeed or pickles run.

``engine.save_checkpoint(DIR)`` writes ``DIR/latest`` (the tag, ``global_stepN``) and ``DIR/TAG/``,
with ``MM`` the model-parallel (tensor-parallel) rank and ``R`` the data-parallel rank:

- ``mp_rank_MM_model_states.pt`` (stage 0-2, written by data-parallel rank 0) or
  ``zero_pp_rank_R_mp_rank_MM_model_states.pt`` (stage 3, one per rank): ``module`` (the
  module's state dict; under stage 3 its parameters are empty, only buffers are whole),
  ``buffer_names``, ``param_shapes`` (per optimizer group, name -> shape, in flattening
  order; stage 3: per sub-group), ``frozen_param_shapes`` / ``frozen_param_fragments`` (stage
  2/3), ``shared_params`` (global rank 0's file only), ``lr_scheduler``, ``global_steps``,
  ``dp_world_size``, ``mp_world_size``, ``ds_config``, ``ds_version``, ``optimizer`` (stage 0
  only), Megatron-DeepSpeed's ``universal_checkpoint_info`` and the client state's keys.
- ``[bf16_]zero_pp_rank_R_mp_rank_MM_optim_states.pt`` (ZeRO, one per rank):
  ``optimizer_state_dict`` holding the rank's flat fp32 partition of each group
  (``single_partition_of_fp32_groups``, stage 1/2, alignment padding already stripped;
  ``fp32_flat_groups``, stage 3) and the base optimizer's state over those partitions
  (``base_optimizer_state``, stage 1/2; ``optimizer_state_dict``, stage 3).

For each model-parallel rank, the fp32 master weights are rebuilt per parameter exactly as
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` does (buffers as
float, frozen parameters, trainable parameters, shared parameters as aliases), and the
optimizer's per-element state (Adam's ``exp_avg``, ``exp_avg_sq``, ...) the same way, per
parameter name. Stage 1/2: each group's partitions, concatenated over ranks, are the group's
parameters back to back (plus ``param_alignment_paddings``); stage 3: each parameter is split
in ``ceil(numel / world)`` pieces, one per rank, the last padded. Files are read one rank at a
time with ``torch_format.read`` (never ``torch.load``), which maps them copy-on-write: the
values are views of the ranks' mapped partitions, never copies of them (``_join``), so an
import holds the files as reclaimable page cache, not as memory of its own (tensors DeepSpeed
pickles with attributes, such as stage 3's ``fp32_flat_groups``, are read as the plain tensors,
the attributes dropped and noted). A parameter inside
one rank's partition is a view; one split over ranks is a ``ckptfmt.Sharded`` of row ranges, one
per rank (owner: data-parallel rank * mp_world_size + model-parallel rank), a row cut by a
split copied as a shard of its own; a split 1-d parameter is copied. ``ckptfmt.save`` keeps
the shards, ``ckptfmt.load`` assembles them. The model-parallel ranks' results are then merged
per name (``_TpMerge``): replicated tensors once, split ones as a ``ckptfmt.Sharded`` of the
model-parallel ranks' parts (their own shards, moved); ``metadata["deepspeed"]["tp_merge"]``
records how each name merged. Pipeline-parallel and mixture-of-experts folders are refused.

The imported state::

    {"module": ..., "fp32": {name: tensor or Sharded}, "optimizer": {"state": {name: {...}}, "param_groups": [...]},
     "lr_scheduler": ..., "client_state": {...}, "global_step": N, "deepspeed": {...}}
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.sharded import Shard, Sharded
from ckptfmt.values import OpaqueObject

from . import torch_format
from .importer import Imported
from .pickles import (
    Node,
    PickleError,
    restricted_loads,
)

LATEST = "latest"
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MOE = re.compile(r"^(expert_|expp_rank_|layer_\d+_expert_)")
_PIPELINE = re.compile(r"^layer_\d+-model")
#: Keys DeepSpeed itself writes into the model states file; every other top-level key is client state.
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
}
#: Keys of a ZeRO optimizer state dict that are per-rank layout, not state (rebuilt or dropped).
_LAYOUT_KEYS = {"base_optimizer_state", "optimizer_state_dict", "single_partition_of_fp32_groups",
                "fp32_flat_groups", "param_slice_mappings", "zero_stage", "ds_version"}


def detect(path: str) -> bool:
    """True for a DeepSpeed checkpoint folder (``latest`` + tag folder) or a tag folder itself."""
    try:
        folder = _tag_folder(path)
    except (CheckpointError, OSError, UnicodeDecodeError):
        return False
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(_MODEL.match(n) or _ZERO3_MODEL.match(n) for n in names)


def _tag_folder(path: str) -> str:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder")
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            tag = f.read(4096).strip()
        if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
            raise CheckpointError(f"{latest}: does not name a checkpoint tag folder ({tag[:80]!r})")
        folder = os.path.join(path, tag)
        if not os.path.isdir(folder):
            raise CheckpointNotFoundError(f"{latest} names {tag!r}, but {folder} is missing")
        return folder
    return path


class _Files:
    """The tag folder's files by (data-parallel rank, model-parallel rank); refuses pipeline and MoE folders."""

    def __init__(self, folder: str):
        self.folder = folder
        names = sorted(os.listdir(folder))
        for name in names:
            if _MOE.match(name):
                raise CheckpointError(f"{os.path.join(folder, name)}: a mixture-of-experts checkpoint: "
                                      "not supported")
            if _PIPELINE.match(name):
                raise CheckpointError(f"{os.path.join(folder, name)}: a pipeline-parallel checkpoint "
                                      "(layer_*-model_states.pt): not supported")
        self.models = {int(m.group(1)): n for n in names if (m := _MODEL.match(n))}
        self.zero3 = {(int(m.group(1)), int(m.group(2))): n for n in names if (m := _ZERO3_MODEL.match(n))}
        self.optims = {(int(m.group(2)), int(m.group(3))): n for n in names if (m := _OPTIM.match(n))}
        prefixes = {n.startswith("bf16_") for n in self.optims.values()}
        if len(prefixes) > 1:
            raise CheckpointError(f"{folder}: holds both bf16_zero_* and zero_* optimizer files")
        self.prefix = "bf16_" if prefixes == {True} else ""

    def main(self, mp: int) -> str:
        """The model states file of model-parallel rank ``mp`` (stage 3: its data-parallel rank 0's)."""
        name = self.models.get(mp) or self.zero3.get((0, mp))
        if name is None:
            raise CheckpointNotFoundError(
                f"{os.path.join(self.folder, f'mp_rank_{mp:02d}_model_states.pt')}: missing (nor "
                f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt): not a complete DeepSpeed checkpoint")
        return name

    def check(self, dp: int, mp: int, zero: bool) -> None:
        """Every (dp, mp) rank's files are there and none beyond, before anything else is read."""
        for rank in range(mp):
            self.main(rank)
        wanted = [(self.zero3, "zero_pp_rank_{}_mp_rank_{:02d}_model_states.pt")] if self.zero3 else []
        if zero:
            wanted.append((self.optims, self.prefix + "zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt"))
        for files, pattern in wanted:
            for key in [(d, m) for m in range(mp) for d in range(dp)]:
                if key not in files:
                    missing = os.path.join(self.folder, pattern.format(*key))
                    raise CheckpointNotFoundError(f"{missing}: missing (dp_world_size {dp}, mp_world_size {mp}): "
                                                  "incomplete checkpoint")
            extra = sorted(k for k in files if k[0] >= dp or k[1] >= mp)
            if extra:
                raise CheckpointError(f"{os.path.join(self.folder, files[extra[0]])}: beyond dp_world_size {dp} "
                                      f"/ mp_world_size {mp}")
        extra = sorted(m for m in self.models if m >= mp)
        if extra:
            raise CheckpointError(f"{os.path.join(self.folder, self.models[extra[0]])}: beyond mp_world_size {mp}")


def read(path: str, tp_dims: dict | None = None) -> Imported:
    """Read a DeepSpeed checkpoint folder as an import (raises CheckpointError naming the file).

    ``tp_dims`` maps a regex (searched in each parameter name, the first match wins) to the
    dimension the model-parallel ranks split that parameter on, or None for replicated; it
    overrides the checkpoint's universal_checkpoint_info and the inference (see ``_TpMerge``).
    """
    path = os.fspath(path)
    folder = _tag_folder(path)
    files = _Files(folder)
    opaque: list[str] = []
    notes: list[str] = []
    first = model = _model_file(folder, files.main(0), opaque, notes)
    dp, mp = model.get("dp_world_size"), model.get("mp_world_size", 1)
    for key, value in (("dp_world_size", dp), ("mp_world_size", mp)):
        if type(value) is not int or value < 1:
            raise CheckpointError(f"{os.path.join(folder, files.main(0))}: {key} is {value!r}")
    files.check(dp, mp, zero=model.get("param_shapes") is not None)
    merge = _TpMerge(folder, mp, tp_dims, model) if mp > 1 else None
    if merge is None and tp_dims:
        notes.append("tp_dims not used: the checkpoint has no model-parallel ranks")
    for rank in range(mp):
        where = os.path.join(folder, files.main(rank))
        if rank:
            model = _model_file(folder, files.main(rank), [], notes)
            _same_run(model, first, where)
        rank_state, stage = _read_mp_rank(folder, files, rank, model, dp, opaque if rank == 0 else [], notes)
        if merge is None:
            state = rank_state
        else:
            merge.add(rank, rank_state, model, stage, where)
    if merge is not None:
        state = merge.finish(notes)
    if stage == 3:
        notes.append("stage 3: 'module' holds the parameters as saved (empty partitions); "
                     "the whole weights are under 'fp32'")
    if opaque:
        shown = ", ".join(opaque[:10]) + (" ..." if len(opaque) > 10 else "")
        notes.append(f"{len(opaque)} object(s) kept opaque (pickled, never run): {shown}")
    step, ds_version = first.get("global_steps"), first.get("ds_version")
    return Imported(state=state, kind="deepspeed", step=step if type(step) is int and step >= 0 else None,
                    metadata=_metadata(first, files, stage, merge),
                    versions={"deepspeed": ds_version} if isinstance(ds_version, str) else {},
                    opaque=opaque, notes=list(dict.fromkeys(notes)))


def _metadata(model: dict, files: _Files, stage: int, merge: _TpMerge | None) -> dict:
    """The import's user metadata: ZeRO stage, topology, dtype, how tensor-parallel ranks merged, the config."""
    config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else None
    meta = {"zero_stage": stage, "dp_world_size": model["dp_world_size"],
            "mp_world_size": model.get("mp_world_size", 1), "bf16": files.prefix == "bf16_" or _bf16(config)}
    if isinstance(model.get("checkpoint_parallel_dimensions"), dict):
        meta["parallel_dimensions"] = model["checkpoint_parallel_dimensions"]
    if merge is not None:
        meta["tp_merge"] = merge.how
    if config is not None:
        meta["config"] = config
    return {"deepspeed": meta}


def _model_file(folder: str, name: str, opaque: list[str], notes: list[str]) -> dict:
    model = _read_file(folder, name, "model_states", opaque, notes)
    if not isinstance(model, dict) or "module" not in model:
        raise CheckpointError(f"{os.path.join(folder, name)}: no 'module': not a DeepSpeed model states file")
    return model


def _same_run(model: dict, first: dict, where: str) -> None:
    """A later model-parallel rank's model states file must describe the same run as rank 0's."""
    for key in ("dp_world_size", "mp_world_size", "global_steps", "ds_version"):
        if model.get(key) != first.get(key):
            raise CheckpointError(f"{where}: {key} is {model.get(key)!r}, model-parallel rank 0 says "
                                  f"{first.get(key)!r}")
    if (model.get("param_shapes") is None) != (first.get("param_shapes") is None):
        raise CheckpointError(f"{where}: ZeRO and non-ZeRO model states files mixed")


def _read_mp_rank(folder: str, files: _Files, mp: int, model: dict, dp: int, opaque: list[str],
                  notes: list[str]) -> tuple[dict, int]:
    """One model-parallel rank's state, its data-parallel partitions merged; and the ZeRO stage."""
    state: dict[str, Any] = {"module": model["module"]}
    if model.get("param_shapes") is None:
        stage = 0
        state["optimizer"] = model.get("optimizer")
        if files.optims and mp == 0:
            notes.append(f"{len(files.optims)} {files.prefix}zero optimizer file(s) of a stage-0 run not read "
                         "(their state is in the model states file's 'optimizer')")
    else:
        optims = {d: n for (d, m), n in files.optims.items() if m == mp}
        zero3 = {d: n for (d, m), n in files.zero3.items() if m == mp}
        builder = _Rebuild(folder, files.main(mp), model, dp, mp, optims, zero3, opaque, notes)
        stage = builder.run()
        state["fp32"] = builder.fp32
        state["optimizer"] = {"state": builder.moments, "param_groups": builder.param_groups}
        state["zero_optimizer"] = builder.extras
    state["lr_scheduler"] = model.get("lr_scheduler")
    state["client_state"] = {k: v for k, v in model.items() if k not in _ENGINE_KEYS}
    state["global_step"] = model.get("global_steps")
    state["deepspeed"] = {
        "zero_stage": stage, "dp_world_size": dp, "mp_world_size": model.get("mp_world_size"),
        "tag": os.path.basename(os.path.normpath(folder)), "buffer_names": model.get("buffer_names"),
        "param_shapes": model.get("param_shapes"), "frozen_param_shapes": model.get("frozen_param_shapes"),
        "shared_params": model.get("shared_params"), "skipped_steps": model.get("skipped_steps"),
        "global_samples": model.get("global_samples"), "data_sampler": model.get("data_sampler"),
        "random_ltd": model.get("random_ltd"),
    }
    if model.get("universal_checkpoint_info") is not None:
        state["deepspeed"]["universal_checkpoint_info"] = model["universal_checkpoint_info"]
    return state, stage


def _bf16(config: dict | None) -> bool:
    section = (config or {}).get("bf16") or (config or {}).get("bfloat16")
    return isinstance(section, dict) and section.get("enabled") is True


def _read_file(folder: str, name: str, key: str, opaque: list[str], notes: list[str]) -> Any:
    """One torch.save file, read without running its pickle; with ``key``, its opaque paths are recorded."""
    part = torch_format.read(os.path.join(folder, name), drop_tensor_attributes=True)
    if key == "model_states":  # where each top-level key ends up in the imported state
        for where in part.opaque:
            top = where.split("/", 1)[0]
            if top in ("module", "optimizer", "lr_scheduler"):
                opaque.append(where)
            elif top not in ("ds_config", "ds_version", "global_steps") and top in _ENGINE_KEYS:
                opaque.append(f"deepspeed/{where}")
            elif top not in _ENGINE_KEYS:
                opaque.append(f"client_state/{where}")
    notes.extend(f"{name}: {n}" for n in part.notes
                 if not n.startswith(("step ", f"{len(part.opaque)} object(s) kept opaque")))
    return part.state


def _tensor(value: Any, where: str) -> torch.Tensor:
    """``value``, checked to be a tensor."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where}: expected a tensor, found {type(value).__name__}")
    return value


def _numel(shape: Any, where: str) -> int:
    if not isinstance(shape, (torch.Size, tuple, list)) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: malformed parameter shape {shape!r}")
    return math.prod(shape)


class _Rebuild:
    """Each parameter's fp32 weight and optimizer state as views of the ranks' mapped flat partitions.

    The ranks' files are read one at a time; each parameter's pieces in them are noted as
    views (never copied), then joined per parameter by ``_join``.
    """

    def __init__(self, folder, main, model, dp, mp, optims, zero3_models, opaque, notes):
        self.folder, self.model, self.dp = folder, model, dp
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
            sd = _read_file(self.folder, name, "", self.opaque, self.notes)
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
                    rank_model = model if rank == 0 else _read_file(
                        self.folder, self.zero3_models[rank], "", self.opaque, self.notes)
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
            for g, (spans, end) in enumerate(self.layout):
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
            for name, shape, _ in self.frozen:
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


# ---------------------------------------------------------------- model-parallel ranks

#: universal_checkpoint_info keys (deepspeed/checkpoint/constants.py) and how ds_to_universal merges them
#: (vocabulary parameters: on dim 0, their padding rows kept rather than cut to original_vocab_size)
_UCI_RULES = (("tp_replicated_parameter_patterns", None), ("parameter_to_average_patterns", "average"),
              ("parameter_with_row_parallelism_patterns", 1), ("vocabulary_parameter_patterns", 0))
#: universal_checkpoint_info layouts this reader does not rebuild (a tp_dims rule for the name overrides)
_UCI_UNSUPPORTED = ("parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params", "affine_map")


class _TpMerge:
    """The model-parallel ranks' states as one, per parameter name: replicated, or shards of a concatenation.

    Rank 0's state is the skeleton. Each later rank's tensors (module, fp32, optimizer moments)
    are compared with rank 0's as they come: an identical one is dropped and rank 0's kept in its
    place, so a replicated tensor is held once. How a name merges comes from the user's
    ``tp_dims``, else the checkpoint's ``universal_checkpoint_info`` (as ds_to_universal reads
    it), else it is inferred: replicated when every tensor of the name is identical on every
    rank, otherwise concatenated on dim 0 (ds_to_universal's default). A concatenation is kept
    as a ``ckptfmt.Sharded`` of each rank's part (or of its data-parallel shards), so the ranks'
    partitions stay as they were.
    """

    def __init__(self, folder: str, size: int, tp_dims: dict | None, model: dict):
        self.folder, self.size = folder, size
        self.user = _compile_tp_dims(tp_dims)
        info = model.get("universal_checkpoint_info")
        self.info = info if isinstance(info, dict) else {}
        self.shared: dict[str, str] = {}
        self.parts: dict[tuple, list] = {}   # path -> each rank's value (rank 0's where identical)
        self.names: dict[tuple, str] = {}
        self.differs: set[str] = set()
        self.rules: dict[str, tuple] = {}
        self.how: dict[str, int | str] = {}
        self.skeleton: dict = {}
        self.optimizers: list = []           # stage 0: the torch optimizer's state dicts, keyed by index
        self.client_states: list = []

    def add(self, rank: int, state: dict, model: dict, stage: int, where: str) -> None:
        """Take model-parallel rank ``rank``'s state (ranks in order, from 0; ``where``: its model file)."""
        self.shared.update({str(k): str(v) for k, v in (model.get("shared_params") or {}).items()})
        tensors = dict(self._tensors(state, model, stage))
        self.client_states.append(state["client_state"])
        if stage == 0:
            self.optimizers.append(state["optimizer"])
        if rank == 0:
            self.skeleton, self.stage, self.names = state, stage, tensors
            self.parts = {path: [_at(state, path)] for path in tensors}
            return
        if stage != self.stage:
            raise CheckpointError(f"{where}: ZeRO stage {stage}, model-parallel rank 0's is {self.stage}")
        if set(tensors) != set(self.names):
            odd = min(set(tensors) ^ set(self.names))
            raise CheckpointError(f"{where}: {'/'.join(map(str, odd))} is on model-parallel rank 0 or rank {rank} "
                                  "only")
        for path, name in tensors.items():
            self._compare(path, name, _at(state, path), rank, where)

    def _tensors(self, state: dict, model: dict, stage: int):
        """(path, parameter name) of every tensor merged across ranks."""
        buffers = set(model.get("buffer_names") or [])
        for name, value in state["module"].items():
            if isinstance(value, torch.Tensor) and (stage != 3 or name in buffers):  # stage 3: empty placeholders
                yield ("module", name), name
        aliases = model.get("shared_params") or {}
        for name in state.get("fp32", {}):
            if not (name in aliases and aliases[name] in state["fp32"]):
                yield ("fp32", name), name
        if stage != 0:
            for name, moments in state["optimizer"]["state"].items():
                for key, value in moments.items():
                    if isinstance(value, (torch.Tensor, Sharded)):
                        yield ("optimizer", "state", name, key), name

    def _compare(self, path: tuple, name: str, value: Any, rank: int, where: str) -> None:
        parts = self.parts[path]
        if _same_bits(parts[0], value):
            parts.append(parts[0])
            return
        how, source = self._rule(name)
        if len(value.shape) == 0:
            raise CheckpointError(f"{where}: {'/'.join(map(str, path))}: a scalar that differs from "
                                  "model-parallel rank 0's")
        if how is None and source is not None:
            raise CheckpointError(f"{where}: {name!r} is replicated ({source}) but its "
                                  f"{'/'.join(map(str, path))} differs from model-parallel rank 0's")
        self.differs.add(self.shared.get(name, name))
        parts.append(value)

    def _rule(self, name: str) -> tuple:
        """(how, source): how = dim, None (replicated) or "average"; source None when left to inference."""
        if name not in self.rules:
            target = self.shared.get(name, name)
            self.rules[name] = self._user_rule(name, target) or self._info_rule(target) or (None, None)
        return self.rules[name]

    def _user_rule(self, name: str, target: str) -> tuple | None:
        for regex, dim in self.user:
            if regex.search(name) or regex.search(target):
                return dim, f"tp_dims {regex.pattern!r}"
        return None

    def _info_rule(self, name: str) -> tuple | None:
        for key in _UCI_UNSUPPORTED:
            if any(re.match(p, name) for p in _patterns(self.info.get(key))):
                raise CheckpointError(f"{self.folder}: {name!r} has a {key} layout in universal_checkpoint_info, "
                                      "which this reader does not rebuild: give its split with tp_dims (--tp-dim)")
        for key, how in _UCI_RULES:
            if any(re.match(p, name) for p in _patterns(self.info.get(key))):
                return how, f"universal_checkpoint_info {key}"
        return None

    def finish(self, notes: list[str]) -> dict:
        """The merged state; records how each name merged in ``how`` and notes the inferred ones."""
        inferred: dict[str, list] = {}
        averaged = []
        for path, name in self.names.items():
            how, source = self._rule(name)
            if source is None:
                how = 0 if self.shared.get(name, name) in self.differs else None
                inferred.setdefault("replicated" if how is None else f"concatenated on dim {how}", []).append(name)
            parts = self.parts[path]
            if how is None or len(parts[0].shape) == 0:  # a scalar (Adam's step) is the same on every rank
                merged = parts[0]
            elif how == "average":
                merged = self._average(path, name, parts)
                if any(p is not parts[0] for p in parts):
                    averaged.append(name)
            else:
                merged = self._concat(path, name, parts, how)
            _put(self.skeleton, path, merged)
            self.how[name] = "replicated" if how is None else how
        fp32 = self.skeleton.get("fp32")
        for alias, target in self.shared.items():
            if fp32 is not None and target in fp32:
                fp32[alias] = fp32[target]
        if self.stage == 0:
            self.skeleton["optimizer"] = self.optimizers
            notes.append("stage 0: the torch optimizer's state is keyed by parameter index, not name: "
                         "'optimizer' holds one state dict per model-parallel rank")
        if not all(_same_tree(c, self.client_states[0]) for c in self.client_states):
            self.skeleton["client_state_by_mp_rank"] = self.client_states
            notes.append("the client state differs between model-parallel ranks: each rank's is in "
                         "'client_state_by_mp_rank'")
        for kind, names in inferred.items():
            names = list(dict.fromkeys(names))
            notes.append(f"{self.size} model-parallel ranks: no tp_dims or universal_checkpoint_info rule, "
                         f"inferred {kind}: {', '.join(names)}")
        if averaged:
            notes.append(f"averaged over the model-parallel ranks (universal_checkpoint_info): "
                         f"{', '.join(dict.fromkeys(averaged))}")
        return self.skeleton

    def _average(self, path: tuple, name: str, parts: list) -> torch.Tensor:
        if all(p is parts[0] for p in parts):
            return parts[0]
        parts = [_whole(p) for p in parts]  # one parameter's copy: averaging makes a new tensor anyway
        if not all(isinstance(p, torch.Tensor) and p.is_floating_point() and p.shape == parts[0].shape
                   and p.dtype == parts[0].dtype for p in parts):
            raise CheckpointError(f"{self.folder}: {name!r} ({'/'.join(map(str, path))}): cannot average "
                                  "tensors of different shapes or dtypes over model-parallel ranks")
        return sum(parts) / len(parts)  # as ds_to_universal does

    def _concat(self, path: tuple, name: str, parts: list, dim: int):
        """The ranks' parts as shards of their concatenation; a part that is itself sharded (over
        data-parallel ranks) gives its shards, moved to the part's place."""
        shape = list(parts[0].shape)
        dtype = _dtype(parts[0])
        if dim >= len(shape) or any(_dtype(p) != dtype or len(p.shape) != len(shape) or
                                    [n for i, n in enumerate(p.shape) if i != dim] !=
                                    [n for i, n in enumerate(shape) if i != dim] for p in parts):
            raise CheckpointError(f"{self.folder}: {name!r} ({'/'.join(map(str, path))}): cannot concatenate "
                                  f"on dim {dim} the model-parallel ranks' {[tuple(p.shape) for p in parts]} "
                                  f"({', '.join(sorted({str(_dtype(p)) for p in parts}))})")
        shards, offset = [], 0
        for rank, part in enumerate(parts):
            pieces = part.shards if isinstance(part, Sharded) else [Shard((0,) * len(shape), part, rank)]
            for piece in pieces:
                offsets = list(piece.offsets)
                offsets[dim] += offset
                shards.append(Shard(tuple(offsets), piece.tensor.contiguous(), rank=piece.rank))
            offset += part.shape[dim]
        shape[dim] = offset
        return Sharded(tuple(shape), shards)


def _patterns(entry: Any) -> list[str]:
    """The regexes a universal_checkpoint_info entry names: a list, sub-parameter dicts, or an affine map."""
    if isinstance(entry, dict):  # affine_map: {"version": ..., "params": {pattern: map}}
        entry = list(entry.get("params") or {})
    patterns = []
    for item in entry if isinstance(entry, list) else []:
        if isinstance(item, dict):  # parameter_with_sub_params: [{"patterns": [...], "shape": ..., ...}]
            patterns.extend(p for p in item.get("patterns") or [] if isinstance(p, str))
        elif isinstance(item, str):
            patterns.append(item)
    return patterns


def _compile_tp_dims(tp_dims: dict | None) -> list[tuple]:
    """tp_dims as (compiled regex, dim or None), checked."""
    rules = []
    for pattern, dim in (tp_dims or {}).items():
        if not isinstance(pattern, str) or not (dim is None or (type(dim) is int and dim >= 0)):
            raise CheckpointError(f"tp_dims: {pattern!r}: {dim!r}: expected a regex and a dimension >= 0 or None "
                                  "(replicated)")
        try:
            rules.append((re.compile(pattern), dim))
        except re.error as exc:
            raise CheckpointError(f"tp_dims: {pattern!r} is not a regular expression: {exc}") from None
    return rules


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _put(tree: Any, path: tuple, value: Any) -> None:
    _at(tree, path[:-1])[path[-1]] = value


def _dtype(value: torch.Tensor | Sharded) -> torch.dtype:
    return value.shards[0].tensor.dtype if isinstance(value, Sharded) else value.dtype


def _whole(value: torch.Tensor | Sharded) -> torch.Tensor:
    """A tensor, or a Sharded assembled into a new one."""
    if isinstance(value, torch.Tensor):
        return value
    out = torch.empty(value.shape, dtype=_dtype(value))
    for shard in value.shards:
        out[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.tensor.shape))] = shard.tensor
    return out


def _rows(value: torch.Tensor | Sharded) -> list[tuple[int, torch.Tensor]]:
    """(first row, tensor) of a tensor whole, or of each shard of a Sharded cut in row ranges (``_join``'s)."""
    if isinstance(value, torch.Tensor):
        return [(0, value)]
    return sorted(((shard.offsets[0], shard.tensor) for shard in value.shards), key=lambda r: r[0])


def _same_rows(a: torch.Tensor | Sharded, b: torch.Tensor | Sharded) -> bool:
    """Identical tensors, either given as row shards: compared range by range, neither assembled."""
    if _dtype(a) != _dtype(b) or tuple(a.shape) != tuple(b.shape):
        return False
    rows_a, rows_b = _rows(a), _rows(b)
    cuts = sorted({r for r, _ in rows_a} | {r for r, _ in rows_b} | {a.shape[0]})
    for lo, hi in pairwise(cuts):
        part_a, part_b = [next(t.narrow(0, lo - r, hi - lo) for r, t in reversed(rows) if r <= lo)
                          for rows in (rows_a, rows_b)]
        if not _same_bits(part_a, part_b):
            return False
    return True


def _same_bits(a: Any, b: Any) -> bool:
    """Identical tensors, bit for bit (NaNs included), or equal plain values."""
    if isinstance(a, Sharded) or isinstance(b, Sharded):
        return isinstance(a, (torch.Tensor, Sharded)) and isinstance(b, (torch.Tensor, Sharded)) \
            and _same_rows(a, b)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return _same_tree(a, b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _same_tree(a: Any, b: Any) -> bool:
    """Equal values, tensors compared bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_bits(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b

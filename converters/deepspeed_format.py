"""Read DeepSpeed checkpoint folders (ZeRO stages 0-3, fp32 or bf16) without DeepSpeed or running pickles.

``engine.save_checkpoint(DIR)`` writes ``DIR/latest`` (the tag, ``global_stepN``) and ``DIR/TAG/``:

- ``mp_rank_00_model_states.pt`` (stage 0-2, written by data-parallel rank 0) or
  ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (stage 3, one per rank): ``module`` (the
  module's state dict; under stage 3 its parameters are empty, only buffers are whole),
  ``buffer_names``, ``param_shapes`` (per optimizer group, name -> shape, in flattening
  order), ``frozen_param_shapes`` / ``frozen_param_fragments`` (stage 2/3), ``shared_params``,
  ``lr_scheduler``, ``global_steps``, ``dp_world_size``, ``ds_config``, ``ds_version``,
  ``optimizer`` (stage 0 only) and the client state's keys.
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (ZeRO, one per data-parallel rank):
  ``optimizer_state_dict`` holding the rank's flat fp32 partition of each group
  (``single_partition_of_fp32_groups``, stage 1/2, alignment padding already stripped;
  ``fp32_flat_groups``, stage 3) and the base optimizer's state over those partitions
  (``base_optimizer_state``, stage 1/2; ``optimizer_state_dict``, stage 3).

The fp32 master weights are rebuilt per parameter exactly as
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` does (buffers as
float, frozen parameters, trainable parameters, shared parameters as aliases), and the
optimizer's per-element state (Adam's ``exp_avg``, ``exp_avg_sq``, ...) the same way, per
parameter name. Stage 1/2: each group's partitions, concatenated over ranks, are the group's
parameters back to back (plus ``param_alignment_paddings``); stage 3: each parameter is split
in ``ceil(numel / world)`` pieces, one per rank, the last padded. Files are read one rank at a
time with ``torch_format.read`` (never ``torch.load``); each rank's pieces are copied into the
result and its files released before the next rank's.

The imported state::

    {"module": ..., "fp32": {name: tensor}, "optimizer": {"state": {name: {...}}, "param_groups": [...]},
     "lr_scheduler": ..., "client_state": {...}, "global_step": N, "deepspeed": {...}}
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from typing import Any

import torch

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.values import OpaqueObject

from . import torch_format
from .importer import Imported
from .pickles import (
    Builder,
    Node,
    PendingTensor,
    PickleError,
    RestrictedUnpickler,
    Storage,
    restricted_loads,
)

LATEST = "latest"
_MODEL_FILE = "mp_rank_00_model_states.pt"
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: Keys DeepSpeed itself writes into the model states file; every other top-level key is client state.
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version",
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
    return _MODEL_FILE in names or any(_ZERO3_MODEL.match(n) for n in names)


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


def read(path: str) -> Imported:
    """Read a DeepSpeed checkpoint folder as an import (raises CheckpointError naming the file)."""
    path = os.fspath(path)
    folder = _tag_folder(path)
    names = sorted(os.listdir(folder))
    opaque: list[str] = []
    notes: list[str] = []

    zero3_models = {int(m.group(1)): n for n in names if (m := _ZERO3_MODEL.match(n))}
    if any(not n.endswith("_mp_rank_00_model_states.pt") for n in zero3_models.values()):
        raise CheckpointError(f"{folder}: model-parallel ZeRO-3 checkpoint: not supported")
    optims = {}
    bf16_prefix = set()
    for n in names:
        m = _OPTIM.match(n)
        if m:
            if m.group(3) != "00":
                raise CheckpointError(f"{os.path.join(folder, n)}: model-parallel rank {m.group(3)}: "
                                      "only checkpoints without tensor/pipeline parallelism can be imported")
            optims[int(m.group(2))] = n
            bf16_prefix.add(bool(m.group(1)))
    if any(re.match(r"^mp_rank_(\d+)_model_states\.pt$", n) and n != _MODEL_FILE for n in names) \
            or any(n.startswith("layer_") for n in names):
        raise CheckpointError(f"{folder}: model- or pipeline-parallel checkpoint: not supported")
    if len(bf16_prefix) > 1:
        raise CheckpointError(f"{folder}: holds both bf16_zero_* and zero_* optimizer files")
    prefix = "bf16_" if bf16_prefix == {True} else ""

    main_name = _MODEL_FILE if _MODEL_FILE in names else zero3_models.get(0)
    if main_name is None:
        raise CheckpointError(f"{folder}: no {_MODEL_FILE} nor zero_pp_rank_0_mp_rank_00_model_states.pt: "
                              "not a DeepSpeed checkpoint")
    model = _read_file(folder, main_name, "model_states", opaque, notes)
    if not isinstance(model, dict) or "module" not in model:
        raise CheckpointError(f"{os.path.join(folder, main_name)}: no 'module': not a DeepSpeed model states file")
    ds_version = model.get("ds_version")
    dp = model.get("dp_world_size")
    if type(dp) is not int or dp < 1:
        raise CheckpointError(f"{os.path.join(folder, main_name)}: dp_world_size is {dp!r}")

    state: dict[str, Any] = {"module": model["module"]}
    zero = model.get("param_shapes") is not None
    config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else None
    if not zero:
        stage = 0
        state["optimizer"] = model.get("optimizer")
        if optims:
            notes.append(f"{len(optims)} {prefix}zero optimizer file(s) of a stage-0 run not read "
                         "(their state is in the model states file's 'optimizer')")
    else:
        # every rank's optimizer file must be there before anything is read
        for rank in range(dp):
            if rank not in optims:
                missing = os.path.join(folder, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
                raise CheckpointNotFoundError(f"{missing}: missing (dp_world_size is {dp}): incomplete checkpoint")
        extra = sorted(set(optims) - set(range(dp)))
        if extra:
            raise CheckpointError(f"{os.path.join(folder, optims[extra[0]])}: rank {extra[0]} beyond "
                                  f"dp_world_size {dp}")
        if zero3_models:
            for rank in range(dp):
                if rank not in zero3_models:
                    raise CheckpointNotFoundError(
                        f"{os.path.join(folder, f'zero_pp_rank_{rank}_mp_rank_00_model_states.pt')}: missing "
                        f"(dp_world_size is {dp}): incomplete checkpoint")
        builder = _Rebuild(folder, model, dp, optims, zero3_models, opaque, notes)
        stage = builder.run()
        state["fp32"] = builder.fp32
        state["optimizer"] = {"state": builder.moments, "param_groups": builder.param_groups}
        state["zero_optimizer"] = builder.extras

    state["lr_scheduler"] = model.get("lr_scheduler")
    state["client_state"] = {k: v for k, v in model.items() if k not in _ENGINE_KEYS}
    step = model.get("global_steps")
    state["global_step"] = step
    state["deepspeed"] = {
        "zero_stage": stage, "dp_world_size": dp, "mp_world_size": model.get("mp_world_size"),
        "tag": os.path.basename(os.path.normpath(folder)), "buffer_names": model.get("buffer_names"),
        "param_shapes": model.get("param_shapes"), "frozen_param_shapes": model.get("frozen_param_shapes"),
        "shared_params": model.get("shared_params"), "skipped_steps": model.get("skipped_steps"),
        "global_samples": model.get("global_samples"), "data_sampler": model.get("data_sampler"),
        "random_ltd": model.get("random_ltd"),
    }
    if stage == 3:
        notes.append("stage 3: 'module' holds the parameters as saved (empty partitions); "
                     "the whole weights are under 'fp32'")
    metadata: dict[str, Any] = {"deepspeed": {"zero_stage": stage, "dp_world_size": dp,
                                              "bf16": prefix == "bf16_" or _bf16(config)}}
    if config is not None:
        metadata["deepspeed"]["config"] = config
    versions = {"deepspeed": ds_version} if isinstance(ds_version, str) else {}
    if opaque:
        shown = ", ".join(opaque[:10]) + (" ..." if len(opaque) > 10 else "")
        notes.append(f"{len(opaque)} object(s) kept opaque (pickled, never run): {shown}")
    return Imported(state=state, kind="deepspeed", step=step if type(step) is int and step >= 0 else None,
                    metadata=metadata, versions=versions, opaque=opaque, notes=notes)


def _bf16(config: dict | None) -> bool:
    section = (config or {}).get("bf16") or (config or {}).get("bfloat16")
    return isinstance(section, dict) and section.get("enabled") is True


def _read_file(folder: str, name: str, key: str, opaque: list[str], notes: list[str]) -> Any:
    """One torch.save file, read without running its pickle; with ``key``, its opaque paths are recorded."""
    part = torch_format.read(os.path.join(folder, name))
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
    """A tensor, also one DeepSpeed pickled with attributes (``ds_id``) that the reader kept opaque."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, OpaqueObject) and (value.module, value.qualname) == ("torch._tensor", "_rebuild_from_type_v2"):
        try:
            node = restricted_loads(value.pickle)
        except PickleError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        if isinstance(node, Node) and node.name == ("torch._tensor", "_rebuild_from_type_v2") and len(node.args) == 4:
            func, new_type, args, _attributes = node.args
            if isinstance(func, Builder) and (func.module, func.qualname) == ("torch._utils", "_rebuild_tensor_v2") \
                    and new_type in (RestrictedUnpickler.TENSOR_TYPE, RestrictedUnpickler.PARAMETER_TYPE) \
                    and type(args) is tuple and len(args) >= 4 and isinstance(args[0], Storage):
                try:
                    return PendingTensor(args[0], args[1], args[2], args[3], False).materialize().detach()
                except PickleError as exc:
                    raise CheckpointError(f"{where}: {exc}") from None
    raise CheckpointError(f"{where}: expected a tensor, found {type(value).__name__}")


def _numel(shape: Any, where: str) -> int:
    if not isinstance(shape, (torch.Size, tuple, list)) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: malformed parameter shape {shape!r}")
    return math.prod(shape)


class _Rebuild:
    """Whole parameters (fp32 and optimizer state) from the ranks' flat partitions, one rank at a time."""

    def __init__(self, folder, model, dp, optims, zero3_models, opaque, notes):
        self.folder, self.model, self.dp = folder, model, dp
        self.optims, self.zero3_models = optims, zero3_models
        self.opaque, self.notes = opaque, notes
        self.fp32: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.moments: dict[str, dict] = {}
        self.param_groups: list = []
        self.extras: dict = {}
        self.main = os.path.join(folder, _MODEL_FILE if _MODEL_FILE in os.listdir(folder)
                                 else zero3_models.get(0, ""))
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
        frozen_parts: dict[str, list] = {}
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
                    fragments = rank_model.get("frozen_param_fragments") or {}
                    for fname in self.frozen:
                        if fname not in fragments:
                            raise CheckpointError(f"{os.path.join(self.folder, self.zero3_models[rank])}: "
                                                  f"no frozen fragment of {fname!r}")
                        frozen_parts.setdefault(fname, []).append(_tensor(fragments[fname], where).clone())
                    del rank_model
            else:
                self._rank12(rank, osd, where)
            del sd, osd
        self._finish(stage, frozen_parts)
        return stage

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
        self.filled: dict[str, int] = {}
        self.scalars: dict[str, dict] = {}
        self.elem_keys: set[str] = set()
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
            self._scatter(params, self.layout[g][0], start, length, {"": part}, gstate, g, where)
            self.offsets[g] += length

    def _scatter(self, params, spans, start, length, master, gstate, g, where):
        """Copy the flat range [start, start+length) of group g into each parameter it overlaps."""
        elem = {}
        for key, value in (gstate or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= length and key != "step":
                elem[key] = value.reshape(-1)[:length]
            elif g not in self.group_scalars or key not in self.group_scalars[g]:
                # a copy: a view would keep the rank's whole mapped file alive
                self.group_scalars.setdefault(g, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for key, flat in list(master.items()) + list(elem.items()):
            self._copy(params, spans, start, length, key, flat)

    def _copy(self, params, spans, start, length, key, flat):
        for (name, shape, numel), begin in zip(params, spans):
            lo, hi = max(begin, start), min(begin + numel, start + length)
            if lo >= hi:
                continue
            target = self._target(name, shape, numel, key, flat.dtype)
            target[lo - begin:hi - begin] = flat[lo - start:hi - start]
            self.filled[f"{key}\0{name}"] = self.filled.get(f"{key}\0{name}", 0) + (hi - lo)

    def _target(self, name, shape, numel, key, dtype) -> torch.Tensor:
        store = self.fp32 if key == "" else self.moments.setdefault(name, {})
        slot = name if key == "" else key
        if slot not in store:
            store[slot] = torch.empty(numel, dtype=dtype)
            if key:
                self.elem_keys.add(key)
        return store[slot]

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
        for name, shape, numel in params:
            piece = math.ceil(numel / self.dp)
            lo = rank * piece
            take = max(0, min(piece, numel - lo))
            if offset + take > starts[-1]:
                raise CheckpointError(f"{where}: the flat partitions hold {starts[-1]} elements, "
                                      f"parameter {name!r} needs {offset + take}")
            for key, parts in sources.items():
                target = self._target(name, shape, numel, key, parts[0].dtype)
                done = 0
                for i, part in enumerate(parts):  # the groups [offset, offset + take) falls in
                    a, b = max(offset, starts[i]), min(offset + take, starts[i + 1])
                    if a < b:
                        target[lo + a - offset:lo + b - offset] = part[a - starts[i]:b - starts[i]]
                        done += b - a
                self.filled[f"{key}\0{name}"] = self.filled.get(f"{key}\0{name}", 0) + done
            offset += piece
        if offset != starts[-1]:
            raise CheckpointError(f"{where}: consumed {offset} of the partitions' {starts[-1]} elements: "
                                  "param_shapes do not match the optimizer partitions")

    # ---------------------------------------------------------------- assembly

    def _finish(self, stage: int, frozen_parts: dict) -> None:
        if stage != 3:
            align = 2 * self.dp
            for g, (spans, end) in enumerate(self.layout):
                if align * math.ceil(end / align) != align * math.ceil(self.offsets[g] / align):
                    raise CheckpointError(f"{self.folder}: group {g}: the parameters need {end} elements, the "
                                          f"partitions hold {self.offsets[g]}: param_shapes do not match")
        params = [p for g in self.groups for p in g]
        for name, shape, numel in params:
            for key in [""] + sorted(self.elem_keys):
                if self.filled.get(f"{key}\0{name}", 0) != numel:
                    raise CheckpointError(f"{self.folder}: {name!r}{' ' + key if key else ''}: the partitions "
                                          f"cover {self.filled.get(f'{key}{chr(0)}{name}', 0)} of {numel} elements")
        # zero_to_fp32's order: buffers, frozen parameters, trainable parameters, shared parameters
        trainable = OrderedDict((name, self.fp32.pop(name).view(shape)) for name, shape, _ in params)
        if stage == 3:
            for name in self.frozen:
                shape = self._frozen_shapes[name]
                self.fp32[name] = torch.cat(frozen_parts[name], 0).narrow(0, 0, math.prod(shape)).view(shape)
        else:
            fragments = self.model.get("frozen_param_fragments") or {}
            for name, shape, _ in self.frozen:
                if name not in fragments:
                    raise CheckpointError(f"{self.main}: no frozen fragment of {name!r}")
                self.fp32[name] = _tensor(fragments[name], f"{self.main}: frozen_param_fragments")
        self.fp32.update(trainable)
        for alias, target in (self.model.get("shared_params") or {}).items():
            if target in self.fp32:
                self.fp32[alias] = self.fp32[target]
        group_of = {}
        for g, group in enumerate(self.groups):
            for name, _, _ in group:
                group_of[name] = g
        for name, shape, _ in params:
            moments = self.moments.setdefault(name, {})
            for key in list(moments):
                moments[key] = moments[key].view(shape)
            scalars = self.group_scalars.get(group_of[name], {})
            scalars = {**scalars, **self.group_scalars.get(-1, {})}
            for key, value in scalars.items():
                moments[key] = value.clone() if isinstance(value, torch.Tensor) else value

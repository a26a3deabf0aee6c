"""Write a DeepSpeed ZeRO checkpoint folder, for any data-parallel degree, from an imported DeepSpeed checkpoint.

DeepSpeed's ``load_checkpoint`` only accepts ZeRO files written by as many ranks as will
read them ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world
size is not currently supported"). An import (``deepspeed_format``) holds every parameter
whole: its fp32 master weight, its optimizer moments, its group. From those this module
lays the partitions out again exactly as DeepSpeed's own optimizers would for ``world_size``
ranks, and writes the files DeepSpeed would have saved (``engine.save_checkpoint``):

- stage 1/2 (``DeepSpeedZeroOptimizer``, and ``BF16_Optimizer``): each group's parameters back
  to back (plus ``param_alignment_paddings``), padded to a multiple of ``2 * world_size``, cut
  in ``world_size`` equal partitions. A rank's fp32 partition is saved without the padding,
  its base optimizer state with it (zeros), in DeepSpeed's "rigid" layout;
- stage 3 (``DeepSpeedZeroOptimizer_Stage3``): each parameter cut in ``ceil(numel / world_size)``
  pieces (the last zero-padded); a rank's pieces back to back in sub-groups of at most
  ``sub_group_size`` elements, one fp32 flat tensor and one optimizer state per sub-group; one
  model states file per rank, parameters empty, frozen parameters as the rank's pieces.

``DEST/latest`` names the tag folder; ``DEST/model.safetensors`` (or 5 GB shards and an index)
holds the consolidated fp32 weights, what ``zero_to_fp32 --safe_serialization`` writes. The tag
folder is written beside and renamed, so a failed export leaves no partial checkpoint. Files
are written one rank at a time, reading each tensor of the checkpoint when it is needed, so
memory holds about one rank's files (plus, for stage 1/2, the module's weights rank 0 saves)
and one parameter. A stage-3 rank needs a piece of every parameter: each rank reads them all
again (cheap for tensors memory-mapped from local chunks, a copy for stored shards).
"""

from __future__ import annotations

import math
import os
import shutil
from collections import OrderedDict
from typing import Any

import torch

import ckptfmt
from ckptfmt.converters.export_files import (
    DEFAULT_SHARD_SIZE,
    ExportResult,
    restore_opaque,
    safetensors_shards,
    write_atomically,
)
from ckptfmt.converters.safetensors_format import OutTensor, write_file
from ckptfmt.errors import CheckpointError
from ckptfmt.format.values import OpaqueObject, decode_tree
from ckptfmt.tensors.dtypes import dtype_from_name
from ckptfmt.tensors.values import torch_value

#: The DeepSpeed version whose save layout this module writes, when the source names none.
LAYOUT_VERSION = "0.19.8"
#: ``deepspeed.runtime.zero.config.ZeroStageEnum(stage)`` as a pickle (DeepSpeed rebuilds it on load;
#: ckptfmt never imports DeepSpeed).
_ZERO_STAGE_PICKLE = b"\x80\x02cdeepspeed.runtime.zero.config\nZeroStageEnum\nK%c\x85R."
_BIT16 = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def to_deepspeed(reader: ckptfmt.CheckpointReader, dest: str, *, world_size: int | None = None,
                 zero_stage: int | None = None, ds_config: dict | None = None) -> ExportResult:
    """Write ``DEST/latest``, ``DEST/TAG/`` (ZeRO files for ``world_size`` ranks) and ``DEST/model.safetensors``.

    ``ds_config`` is the configuration the files will be loaded with (default: the one the
    checkpoint recorded); it decides bf16/fp16, ``sub_group_size`` and
    ``parameter_alignment``. ``zero_stage`` (1, 2 or 3) and ``world_size`` override its stage
    and the recorded data-parallel degree.
    """
    state = decode_tree(reader.manifest.state, lambda index: _Lazy(reader, index), torch_value=torch_value)
    source = _Source(reader, state)
    config = dict(ds_config if ds_config is not None else source.config)
    zero = dict(config.get("zero_optimization") or {})
    stage = zero_stage if zero_stage is not None else zero.get("stage", source.stage)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"ZeRO stage {stage!r}: export writes stages 1, 2 and 3")
    zero["stage"] = stage
    config["zero_optimization"] = zero
    world = world_size if world_size is not None else source.dp
    if type(world) is not int or world < 1:
        raise CheckpointError(f"world size {world!r}: expected a positive number of data-parallel ranks")
    if zero.get("round_robin_gradients"):
        raise CheckpointError("zero_optimization.round_robin_gradients reorders each group's parameters: not supported")
    tag = source.tag
    if not isinstance(tag, str) or not tag or os.sep in tag or tag in (".", ".."):
        raise CheckpointError(f"tag {tag!r}: expected a folder name such as global_step100")
    target = _Target(config, stage, world, source)

    folder = os.path.join(dest, tag)
    if os.path.exists(folder):
        raise CheckpointError(f"{folder}: already exists; export writes a new tag folder")
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{dest}: cannot create the output folder: {exc}") from exc
    tmp = os.path.join(dest, f".{tag}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    try:
        files = target.write(tmp)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomically(os.path.join(dest, "latest"), lambda path: _write_text(path, tag))
    weights = source.write_consolidated(dest)
    paths = [os.path.join(folder, f) for f in files] + weights
    notes = [f"ZeRO stage {stage} for {world} data-parallel rank(s), "
             f"{target.precision} ({'bf16_' if target.precision == 'bf16' else ''}zero_* files); "
             f"the source was stage {source.stage} on {source.dp} rank(s)"]
    notes.extend(target.notes)
    size = sum(os.path.getsize(p) for p in paths)
    return ExportResult(dest, len(source.fp32), size, notes, paths)


class _Lazy:
    """A tensor of the checkpoint, read only when used (one at a time, so memory holds about one)."""

    def __init__(self, reader: ckptfmt.CheckpointReader, index: int):
        entry = reader.manifest.tensors[index]
        self.reader, self.key = reader, entry.key
        self.shape = tuple(entry.shape)
        self.dtype = dtype_from_name(entry.dtype)
        self.numel = math.prod(self.shape)

    def load(self) -> torch.Tensor:
        return self.reader.get_tensor(self.key)


def _materialize(value: Any) -> Any:
    """``value`` with every lazy tensor read (for the small trees a file stores as they are)."""
    if isinstance(value, _Lazy):
        return value.load()
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _materialize(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_materialize(v) for v in value)
    return value


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


class _Source:
    """What an imported DeepSpeed checkpoint holds, checked: whole parameters and their groups."""

    def __init__(self, reader: ckptfmt.CheckpointReader, state: Any):
        where = reader.url
        ds = state.get("deepspeed") if isinstance(state, dict) else None
        if not isinstance(ds, dict) or not isinstance(ds.get("param_shapes"), list):
            raise CheckpointError(f"{where}: not imported from a DeepSpeed ZeRO checkpoint "
                                  "(no deepspeed/param_shapes); "
                                  "export --format deepspeed rebuilds ZeRO files from one")
        self.stage, self.dp, self.tag = ds.get("zero_stage"), ds.get("dp_world_size"), ds.get("tag")
        if self.stage == 0 or "fp32" not in state:
            raise CheckpointError(f"{where}: a ZeRO stage-0 checkpoint holds a plain torch optimizer, no ZeRO "
                                  "partitions; DeepSpeed loads it at any world size as it is")
        if ds.get("mp_world_size") not in (None, 1):
            raise CheckpointError(f"{where}: model-parallel degree {ds.get('mp_world_size')}: export writes "
                                  "data-parallel ZeRO checkpoints only")
        metadata = reader.metadata
        self.config = ((metadata.get("user") or {}).get("deepspeed") or {}).get("config") or {}
        self.fp16 = _enabled(self.config, "fp16")
        versions = (metadata.get("provenance") or {}).get("versions") or {}
        self.version = versions.get("deepspeed") or LAYOUT_VERSION
        self.state, self.ds = state, ds
        self.module = state["module"]
        self.fp32 = state["fp32"]
        optimizer = state.get("optimizer") or {}
        self.moments = optimizer.get("state") or {}
        self.param_groups = optimizer.get("param_groups") or []
        self.extras = state.get("zero_optimizer") or {}
        self.groups = self._groups(ds["param_shapes"], where)
        self.shared = ds.get("shared_params") or {}
        self.buffers = list(ds.get("buffer_names") or [])
        self.frozen = self._frozen(ds)
        for group in self.groups:
            for name, shape in group:
                tensor = self.fp32.get(name)
                if not isinstance(tensor, _Lazy) or tensor.shape != shape:
                    raise CheckpointError(f"{where}: fp32/{name}: missing or not of shape {shape}")

    def _groups(self, param_shapes: list, where: str) -> list[list[tuple[str, tuple]]]:
        """The optimizer groups' parameters and shapes, in flattening order.

        param_shapes has one entry per group (stage 1/2) or per sub-group (stage 3); the
        imported param_groups name each group's parameters, so they decide when present.
        """
        shapes = {str(n): tuple(s) for group in param_shapes for n, s in group.items()}
        if not self.param_groups:
            return [[(str(n), tuple(s)) for n, s in group.items()] for group in param_shapes]
        groups = []
        for i, group in enumerate(self.param_groups):
            names = group.get("params") if isinstance(group, dict) else None
            if not isinstance(names, list) or not all(isinstance(n, str) and n in shapes for n in names):
                raise CheckpointError(f"{where}: optimizer/param_groups[{i}]/params does not name parameters "
                                      "of deepspeed/param_shapes")
            groups.append([(n, shapes[n]) for n in names])
        if sum(map(len, groups)) != len(shapes):
            raise CheckpointError(f"{where}: optimizer/param_groups list {sum(map(len, groups))} parameters, "
                                  f"deepspeed/param_shapes {len(shapes)}")
        return groups

    def _frozen(self, ds: dict) -> OrderedDict:
        """Frozen parameters' shapes: recorded from stage 2 on; for stage 1, the module's other parameters."""
        if ds.get("frozen_param_shapes"):
            return OrderedDict((str(n), tuple(s)) for n, s in ds["frozen_param_shapes"].items())
        trainable = {n for group in self.groups for n, _ in group}
        return OrderedDict((n, v.shape) for n, v in self.module.items()
                           if isinstance(v, _Lazy) and n not in trainable and n not in self.buffers
                           and n not in self.shared and v.numel > 0)

    def write_consolidated(self, dest: str) -> list[str]:
        """The fp32 weights zero_to_fp32 writes (buffers, frozen, trainable, shared), as its safe_serialization
        does: ``model.safetensors``, or Hugging Face shards of 5 GB with an index; one tensor in memory at a time."""
        tensors = [OutTensor(name, value.dtype, value.shape, value.load)
                   for name, value in self.fp32.items() if isinstance(value, _Lazy)]
        metadata = {"format": "pt"}
        if sum(t.nbytes for t in tensors) <= DEFAULT_SHARD_SIZE:
            path = os.path.join(dest, "model.safetensors")
            write_atomically(path, lambda tmp: write_file(tmp, tensors, metadata))
            return [path]
        return safetensors_shards(dest, tensors, metadata, DEFAULT_SHARD_SIZE, []).files

    def group_scalars(self, g: int) -> dict:
        """Per-group optimizer values that are not per element (Adam's ``step``), from the group's first parameter."""
        name, shape = self.groups[g][0]
        return {k: v for k, v in self.moments.get(name, {}).items()
                if not (isinstance(v, _Lazy) and v.shape == shape and len(shape) > 0)}

    def element_keys(self, g: int) -> list[str]:
        """The optimizer's per-element state keys of group g (``exp_avg``, ``exp_avg_sq``), in a stable order."""
        name, shape = self.groups[g][0]
        return [k for k, v in self.moments.get(name, {}).items()
                if isinstance(v, _Lazy) and v.shape == shape and len(shape) > 0]

    def flat(self, name: str, key: str = "") -> torch.Tensor:
        """Parameter ``name``'s fp32 master weight (``key`` ""), or its optimizer state ``key``, flat, read now."""
        value = self.fp32.get(name) if not key else self.moments.get(name, {}).get(key)
        if not isinstance(value, _Lazy):
            raise CheckpointError(f"{'fp32/' + name if not key else f'optimizer/state/{name}/{key}'} is missing")
        return value.load().reshape(-1)

    def hyper_parameters(self, g: int) -> dict:
        group = dict(self.param_groups[g])
        group.pop("params", None)
        group.pop("param_names", None)
        return group


class _Target:
    """The ZeRO layout DeepSpeed will build for ``world`` ranks, and the files that match it."""

    def __init__(self, config: dict, stage: int, world: int, source: _Source):
        self.config, self.stage, self.world, self.source = config, stage, world, source
        self.notes: list[str] = []
        self.precision = ("bf16" if _enabled(config, "bf16") or _enabled(config, "bfloat16")
                          else "fp16" if _enabled(config, "fp16") else "fp32")
        self.bit16 = _BIT16[self.precision]
        zero = config["zero_optimization"]
        self.sub_group_size = int(zero.get("sub_group_size", 10**9))
        self.parameter_alignment = bool(zero.get("parameter_alignment", False))
        if not source.param_groups:
            if stage == 3:
                raise CheckpointError("the source recorded no optimizer param_groups (an elastic ZeRO checkpoint): "
                                      "stage-3 files need them")
            self.notes.append("the source recorded no param_groups (elastic): written in DeepSpeed's elastic layout, "
                              "hyper-parameters come from the loading run")
        extras = source.extras
        self.global_state = {k: _materialize(extras[k]) for k in ("loss_scaler", "dynamic_loss_scale", "overflow")
                             if k in extras}
        if (self.precision == "fp16") != source.fp16:  # a static scaler of 1 must not replace fp16's dynamic one
            self.global_state = {}
            self.notes.append("the loss scaler is left to the loading run (the source was "
                              f"{'' if source.fp16 else 'not '}fp16)")
        if stage == 3 and len(self.global_state) < 3:
            raise CheckpointError("stage-3 files need the source's loss_scaler, dynamic_loss_scale and overflow, "
                                  "from a source of the same precision family (fp16 or not)")

    # ---------------------------------------------------------------- files

    def write(self, folder: str) -> list[str]:
        """Every file of the tag folder, one rank at a time; returns their names."""
        names = []
        prefix = "bf16_" if self.precision == "bf16" else ""
        for rank in range(self.world):  # each file's tensors are built, saved and released before the next
            name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            optim = self._optim_states_12 if self.stage < 3 else self._optim_states_3
            _save({"optimizer_state_dict": optim(rank),
                   "ds_config": self.config, "ds_version": self.source.version}, os.path.join(folder, name))
            names.append(name)
            if self.stage == 3 or rank == 0:
                name = (f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage == 3
                        else "mp_rank_00_model_states.pt")
                _save(self._model_states(rank), os.path.join(folder, name))
                names.append(name)
        return names

    def _model_states(self, rank: int) -> dict:
        src = self.source
        frozen_shapes = frozen_fragments = None
        if self.stage >= 2 and src.frozen:  # what DeepSpeed saves from stage 2 on
            frozen_shapes = OrderedDict((n, torch.Size(s)) for n, s in src.frozen.items())
            frozen_fragments = OrderedDict((n, self._frozen_fragment(n, rank)) for n in src.frozen)
        states = {
            "module": self._module(),
            "buffer_names": src.buffers,
            "optimizer": None,
            "param_shapes": self._param_shapes(),
            "frozen_param_shapes": frozen_shapes,
            "shared_params": src.shared,
            "frozen_param_fragments": frozen_fragments,
            "lr_scheduler": _materialize(src.state.get("lr_scheduler")),
            "data_sampler": _materialize(src.ds.get("data_sampler")),
            "random_ltd": _materialize(src.ds.get("random_ltd")),
            "skipped_steps": src.ds.get("skipped_steps") or 0,
            "global_steps": src.state.get("global_step") or 0,
            "global_samples": src.ds.get("global_samples") or 0,
            "dp_world_size": self.world,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": self.config,
            "ds_version": src.version,
        }
        client = _materialize(src.state.get("client_state") or {})
        clash = sorted(set(client) & set(states))
        if clash:
            raise CheckpointError(f"client state key(s) {clash} would overwrite DeepSpeed's own")
        states.update(client)
        return states

    def _param_shapes(self) -> list[OrderedDict]:
        """name -> shape per group (stage 1/2) or per sub-group (stage 3), as DeepSpeed records them."""
        src = self.source
        if self.stage < 3:
            return [OrderedDict((n, torch.Size(s)) for n, s in group) for group in src.groups]
        shapes = {n: s for group in src.groups for n, s in group}
        return [OrderedDict((n, torch.Size(shapes[n])) for n in names)
                for g in range(len(src.groups)) for names in self._sub_groups(g)]

    def _module(self) -> OrderedDict:
        """The module's state dict in the target precision (stage 3: parameters empty, as DeepSpeed saves them)."""
        src = self.source
        trainable = {n for group in src.groups for n, _ in group}
        module = OrderedDict()
        for name, value in src.module.items():
            if name in src.buffers or not isinstance(value, _Lazy):
                module[name] = _materialize(value)
                continue
            if self.stage == 3:
                module[name] = torch.empty(0, dtype=self.bit16)
                continue
            alias = src.shared.get(name, name)
            whole = src.fp32.get(alias) if alias in trainable or value.numel == 0 else value
            if not isinstance(whole, _Lazy):
                raise CheckpointError(f"module/{name}: no whole weight in the checkpoint (fp32/{alias} is missing)")
            module[name] = whole.load().to(self.bit16, copy=True) if alias in trainable else whole.load()
        return module

    def _frozen_fragment(self, name: str, rank: int) -> torch.Tensor:
        src = self.source
        whole = src.fp32.get(name)
        if not isinstance(whole, _Lazy):
            whole = src.module.get(name)
        if not isinstance(whole, _Lazy) or whole.numel != math.prod(src.frozen[name]):
            raise CheckpointError(f"frozen parameter {name!r}: no whole value in the checkpoint")
        whole = whole.load().to(self.bit16, copy=True)
        if self.stage < 3:
            return whole
        return _piece(whole.reshape(-1), rank, self.world)

    # ---------------------------------------------------------------- stage 1/2

    def _layout_12(self, g: int) -> tuple[list[int], list[int], int]:
        """Offsets and alignment paddings of group g's parameters, and the padded flat length (as DeepSpeed)."""
        params = self.source.groups[g]
        itemsize = torch.empty(0, dtype=self.bit16).element_size()
        align = 16 // math.gcd(16, itemsize) if self.parameter_alignment else 1
        offsets, paddings, offset = [], [], 0
        for i, (_, shape) in enumerate(params):
            offsets.append(offset)
            offset += math.prod(shape)
            pad = 0 if i == len(params) - 1 else (-offset) % align
            paddings.append(pad)
            offset += pad
        return offsets, paddings, offset

    def _optim_states_12(self, rank: int) -> dict:
        src = self.source
        partitions, states, paddings_out, layout_paddings = [], {}, [], []
        for g, params in enumerate(src.groups):
            offsets, pads, used = self._layout_12(g)
            align = 2 * self.world
            size = math.ceil(used / align) * align // self.world
            left = rank * size
            padding = size if used <= left else max(0, left + size - used)
            lean = size - padding
            master = torch.zeros(size, dtype=torch.float32)
            elems = {key: torch.zeros(size, dtype=torch.float32) for key in src.element_keys(g)}
            for (name, shape), begin in zip(params, offsets):
                lo, hi = max(begin, left), min(begin + math.prod(shape), left + size)
                if lo >= hi:
                    continue
                master[lo - left:hi - left] = src.flat(name)[lo - begin:hi - begin]
                for key, flat in elems.items():
                    flat[lo - left:hi - left] = src.flat(name, key)[lo - begin:hi - begin]
            partitions.append(master[:lean])  # a view: torch.save keeps it lean, with no copy made here
            group_state = {**_scalars(src.group_scalars(g)), **elems}
            states[g] = group_state if src.param_groups else {k: (v[:lean] if k in elems else v)
                                                                 for k, v in group_state.items()}
            paddings_out.append(padding)
            layout_paddings.append(pads)
        optim: dict[str, Any] = dict(self.global_state)
        clip = self.config.get("gradient_clipping", self.source.extras.get("clip_grad"))
        if clip is not None:
            optim["clip_grad"] = clip
        if src.param_groups:
            optim["base_optimizer_state"] = {
                "state": states,
                "param_groups": [{**src.hyper_parameters(g), "params": [g]} for g in range(len(src.groups))]}
        else:
            optim["base_optimizer_state"] = [states[g] for g in range(len(src.groups))]
            step = _scalars(src.group_scalars(0)).get("step")
            optim["base_optimizer_state_step"] = step.item() if isinstance(step, torch.Tensor) else step
        optim.update({
            "single_partition_of_fp32_groups": partitions,
            "zero_stage": _zero_stage(self.stage),
            "group_paddings": paddings_out,
            "param_alignment_paddings": layout_paddings,
            "partition_count": [self.world] * len(src.groups),
            "ds_version": src.version,
        })
        return optim

    # ---------------------------------------------------------------- stage 3

    def _sub_groups(self, g: int) -> list[list[str]]:
        """Group g's parameters in DeepSpeed's sub-groups (_create_fp16_sub_groups) of the rank's pieces."""
        params = self.source.groups[g]
        piece = [math.ceil(math.prod(shape) / self.world) for _, shape in params]
        if self.sub_group_size >= sum(piece):
            return [[n for n, _ in params]]
        groups, current, size = [], [], 0
        for (name, _), numel in zip(params, piece):
            current.append(name)
            size += numel
            if size >= self.sub_group_size or name == params[-1][0]:
                groups.append(current)
                current, size = [], 0
        return groups

    def _optim_states_3(self, rank: int) -> dict:
        src = self.source
        flats, states, param_groups = [], {}, []
        for g in range(len(src.groups)):
            indices = []
            numel = {n: math.prod(shape) for n, shape in src.groups[g]}
            for names in self._sub_groups(g):
                sizes = [math.ceil(numel[n] / self.world) for n in names]
                state = _scalars(src.group_scalars(g))
                master = torch.zeros(sum(sizes), dtype=torch.float32)
                elems = {key: torch.zeros(sum(sizes), dtype=torch.float32) for key in src.element_keys(g)}
                start = 0
                for name, size in zip(names, sizes):  # each parameter's piece, written in place
                    _copy_piece(master[start:start + size], src.flat(name), rank)
                    for key, flat in elems.items():
                        _copy_piece(flat[start:start + size], src.flat(name, key), rank)
                    start += size
                state.update(elems)
                states[len(flats)] = state
                indices.append(len(flats))
                flats.append(master)
            param_groups.append({**src.hyper_parameters(g), "params": indices})
        return {
            "zero_stage": _zero_stage(3),
            **self.global_state,
            "partition_count": self.world,
            "optimizer_state_dict": {"state": states, "param_groups": param_groups},
            "fp32_flat_groups": flats,
        }


def _enabled(config: dict, section: str) -> bool:
    """A DeepSpeed config's ``{section: {"enabled": true}}``."""
    value = config.get(section)
    return isinstance(value, dict) and value.get("enabled") is True


def _piece(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's stage-3 piece of a flat parameter: ceil(numel / world) elements, zero-padded past the end."""
    out = torch.zeros(math.ceil(flat.numel() / world), dtype=flat.dtype)
    _copy_piece(out, flat, rank)
    return out


def _copy_piece(out: torch.Tensor, flat: torch.Tensor, rank: int) -> None:
    """Copy rank's stage-3 piece of ``flat`` (``out.numel()`` elements from rank * that) into zeroed ``out``."""
    size = out.numel()
    lo, hi = rank * size, min((rank + 1) * size, flat.numel())
    if lo < hi:
        out[:hi - lo] = flat[lo:hi]


def _scalars(values: dict) -> dict:
    """Per-group optimizer values, read (tensors copied, so no file holds a view of another's)."""
    return {k: v.load().clone() if isinstance(v, _Lazy) else v for k, v in values.items()}


def _zero_stage(stage: int) -> OpaqueObject:
    return OpaqueObject("deepspeed.runtime.zero.config", "ZeroStageEnum", _ZERO_STAGE_PICKLE % stage)


def _save(value: dict, path: str) -> None:
    """torch.save with opaque objects (the source's LossScaler, ZeroStageEnum) written back as their pickles."""
    torch.save(restore_opaque(value, []), path)

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
parameter name, by ``deepspeed_zero.Rebuild``. Files are read one rank at a time with
``torch_format.read`` (never ``torch.load``), which maps them copy-on-write; the values are
views of the ranks' partitions, so an import holds the files as reclaimable page cache, not
as memory of its own (tensors DeepSpeed pickles with attributes, such as stage 3's
``fp32_flat_groups``, are read as the plain tensors, the attributes dropped and noted). The
model-parallel ranks' results are then merged per name by ``deepspeed_tp.TpMerge``.
Pipeline-parallel and mixture-of-experts folders are refused.

The imported state::

    {"module": ..., "fp32": {name: tensor or Sharded}, "optimizer": {"state": {name: {...}}, "param_groups": [...]},
     "lr_scheduler": ..., "client_state": {...}, "global_step": N, "deepspeed": {...}}
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptfmt.converters import torch_format
from ckptfmt.converters.deepspeed_tp import TpMerge
from ckptfmt.converters.deepspeed_zero import Rebuild
from ckptfmt.converters.importer import Imported
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError

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
    overrides the checkpoint's universal_checkpoint_info and the inference (see ``TpMerge``).
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
    merge = TpMerge(folder, mp, tp_dims, model) if mp > 1 else None
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


def _metadata(model: dict, files: _Files, stage: int, merge: TpMerge | None) -> dict:
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
        builder = Rebuild(folder, files.main(mp), model, dp, mp, optims, zero3, opaque, notes,
                          lambda name: _read_file(folder, name, "", opaque, notes))
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

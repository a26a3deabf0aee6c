"""The torch objects of a value tree: extensions 8-10 (spec 7.2) as torch.dtype, torch.Size and
torch.device, for the readers that give a state back (``format/values.py`` decodes them to
``TorchValue`` placeholders otherwise)."""

from __future__ import annotations

from typing import Any

import torch

from ckptfmt.tensors.dtypes import dtype_from_name


def torch_value(kind: str, value: Any) -> Any:
    """The torch object of an extension 8, 9 or 10 payload (``decode_tree(..., torch_value=torch_value)``)."""
    if kind == "dtype":
        return dtype_from_name(value)
    if kind == "size":
        return torch.Size(value)
    return torch.device(value)

"""A state's plain values by key (``optim/param_groups/0/lr``): the numbers, strings and flags of a
value tree (spec 7) with its tensors left out, as diff, compare, certify and a resume's check read them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ckptfmt.format.values import decode_tree, format_key

if TYPE_CHECKING:
    from ckptfmt.format.manifest import Manifest


class _Tensor:
    """Where a tensor sits in a decoded value tree (plain values only are compared)."""


#: What a decoded tree holds where a tensor is (``plain_tree``).
TENSOR = _Tensor()


def plain_tree(manifest: Manifest) -> Any:
    """The state's value tree from the manifest alone, ``TENSOR`` where a tensor is."""
    return decode_tree(manifest.state, lambda index: TENSOR)


def plain_values(manifest: Manifest) -> dict[str, Any]:
    """The state's plain values by key (``optim/param_groups/0/lr``), from the manifest alone (see
    ``plain_leaves``)."""
    return {format_key(path): value for path, value in plain_leaves(plain_tree(manifest))}


def plain_leaves(tree: Any) -> Iterator[tuple[tuple, Any]]:
    """(path, value) for every plain value of a decoded value tree, in order, tensors left out.

    A list or tuple of plain scalars (``betas``, ``base_lrs``) is one value, as is an empty container.
    Walked without recursion: a map may nest as deep as msgpack allows.
    """
    stack = [iter([((), tree)])]
    while stack:
        for path, value in stack[-1]:
            if value is TENSOR:
                continue
            if _is_container(value):
                stack.append(_children(path, value))
                break
            yield path, value
        else:
            stack.pop()


def _is_container(value: Any) -> bool:
    if isinstance(value, dict):
        return bool(value)
    return isinstance(value, (list, tuple)) and not all(_is_scalar(item) for item in value)


def _is_scalar(value: Any) -> bool:
    return value is not TENSOR and not isinstance(value, (dict, list, tuple))


def _children(path: tuple, value: dict | list | tuple) -> Iterator[tuple[tuple, Any]]:
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        yield path + (key,), item

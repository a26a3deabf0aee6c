"""What the commands share: the exit code of one that finds something (docs/usage.md, Exit codes),
metadata made printable as JSON, and show's default limit (also in the parser's help)."""

from __future__ import annotations

from typing import Any

from ckptfmt.errors import quoted
from ckptfmt.tools.formatting import short

#: Tensors ``show`` lists in a terminal unless told otherwise (into a pipe: all of them).
SHOW_LIMIT = 50


def found(something) -> int:
    """An analysis command's exit code (docs/usage.md, Exit codes): 1 when it found something (a difference,
    a straggler), 0 when it found nothing; 2, when it cannot run, comes from the error."""
    return 1 if something else 0


#: Levels of metadata shown as JSON; deeper values (a user value tree may nest 256 deep) are elided.
_JSON_DEPTH = 32


def jsonable(value: Any, depth: int = 0) -> Any:
    """Make metadata printable as JSON (bytes summarised, tuples as lists, keys as strings, depth bounded)."""
    if isinstance(value, (dict, list, tuple, set, frozenset)) and depth == _JSON_DEPTH:
        return f"<nested deeper than {_JSON_DEPTH} levels>"
    if isinstance(value, dict):
        return {short(k, 200) if isinstance(k, str) else quoted(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return quoted(value)

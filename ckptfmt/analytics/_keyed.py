"""Results that were dicts: ``result["key"]`` keeps working for a deprecation period, with a DeprecationWarning
naming the attribute to use (as ``ckptfmt._deprecation`` does for renamed arguments)."""

from __future__ import annotations

import warnings
from typing import Any


class KeyedResult:
    """A typed result whose function returned a dict before: indexing it by the dict's keys still works,
    warning. Subclasses say which function returns them (``_returned_by``) and give that dict (``_as_dict``)."""

    #: How the warning names the call that returns the result: ``"stragglers()"``.
    _returned_by: str = ""

    def _as_dict(self) -> dict[str, Any]:
        """The dict the function returned before its result was typed."""
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        warnings.warn(f"{self._returned_by}[{key!r}] is deprecated: use .{key}", DeprecationWarning, stacklevel=2)
        return self._as_dict()[key]

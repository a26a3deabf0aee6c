"""Renamed keyword arguments keep working for a while, with a DeprecationWarning naming the new spelling.

Public functions that do the same kind of work take their arguments the same way (two checkpoints or
runs are ``a`` and ``b``, a run is ``repo``, progress is ``callback=``, a mean time between failures is
``mtbf``); the spellings they had before stay accepted here rather than breaking callers' code.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed_arguments(**renames: str) -> Callable[[F], F]:
    """Accept each ``old=`` keyword of ``renames`` (``old="new"``) as ``new=``, with a DeprecationWarning."""

    def decorate(function: F) -> F:
        parameters = list(inspect.signature(function).parameters)

        @functools.wraps(function)
        def accepting_old_names(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs or new in parameters[:len(args)]:
                    raise TypeError(f"{function.__name__}() got both {old}= and {new}=; {old}= is its old name")
                warnings.warn(f"{function.__name__}({old}=...) is deprecated: use {new}=",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return accepting_old_names  # type: ignore[return-value]

    return decorate

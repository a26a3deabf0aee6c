"""ckptfmt.tui: the terminal UI (``ckptfmt tui TARGET`` or ``ckptfmt tui A B``).

The app needs textual (``pip install 'ckptfmt[tui]'``); the core library never
imports this package. ``CheckpointApp``, ``create_app`` and ``main`` are loaded
on first use, so that registering the ``tui`` command (``ckptfmt.tui.cli``)
costs no textual import.
"""

from __future__ import annotations

__all__ = ["CheckpointApp", "create_app", "main"]


def __getattr__(name: str):
    if name in __all__:
        from ckptfmt.tui import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""ckptfmt.tui: the terminal UI (``ckptfmt tui TARGET`` or ``ckptfmt tui A B``).

Importing this package needs textual (``pip install ckptfmt[tui]``); the core
library never imports it.
"""

from .app import CheckpointApp, create_app, main

__all__ = ["CheckpointApp", "create_app", "main"]

"""Converters between ckptfmt and other checkpoint formats (importable as ``ckptfmt.converters``).

``import_checkpoint(src, "REPO/NAME")`` imports a torch.save file (zip or legacy; pickles are
never run: see ``pickles``) or, where its module is present, a safetensors file;
``export_checkpoint`` writes a checkpoint back as torch.save or safetensors.

They depend on the core, never the reverse. The names load on first use, so that registering
the ``import`` and ``export`` commands (``ckptfmt.converters.cli``) loads neither torch nor a
converter.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["ExportResult", "ImportResult", "Imported", "export_checkpoint", "import_checkpoint"]
_WHERE = {"ExportResult": "export", "export_checkpoint": "export",
          "ImportResult": "importer", "Imported": "importer", "import_checkpoint": "importer"}

if TYPE_CHECKING:
    from ckptfmt.converters.export import ExportResult, export_checkpoint
    from ckptfmt.converters.importer import Imported, ImportResult, import_checkpoint


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

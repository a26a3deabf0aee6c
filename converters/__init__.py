"""Converters between ckptfmt and other checkpoint formats (importable as ``ckptfmt.converters``).

``import_checkpoint(src, "REPO/NAME")`` imports a torch.save file (zip or legacy; pickles are
never run: see ``pickles``) or, where its module is present, a safetensors file;
``export_checkpoint`` writes a checkpoint back as torch.save or safetensors.

They depend on the core, never the reverse.
"""

from ckptfmt.converters.export import ExportResult, export_checkpoint
from ckptfmt.converters.importer import Imported, ImportResult, import_checkpoint

__all__ = ["ExportResult", "ImportResult", "Imported", "export_checkpoint", "import_checkpoint"]

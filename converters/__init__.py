"""Converters between ckptfmt and other checkpoint formats (importable as ``ckptfmt.converters``).

They depend on the core, never the reverse.
"""

from .export import ExportResult, export_checkpoint

__all__ = ["ExportResult", "export_checkpoint"]

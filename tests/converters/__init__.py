"""Importers and exporters against files written by the real tools."""

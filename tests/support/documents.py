"""What the documents say: the dotted names ``ckptfmt.x.y`` that README.md, docs/ and spec/ use."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Names that look like dotted paths in the docs but are files, entry point groups or the metadata keys of
#: exported safetensors files, not attributes.
NOT_ATTRIBUTES = {"ckptfmt.json", "ckptfmt.commands", "ckptfmt.step", "ckptfmt.prefix", "ckptfmt.source",
                  "ckptfmt.id"}
#: Packages of their own (``import ckptfmt.converters``): the core never imports them.
PACKAGES = {"ckptfmt.converters", "ckptfmt.tui", "ckptfmt.integrations"}


def in_own_package(path: str) -> bool:
    """Whether a dotted name lies in one of the PACKAGES (imported, not reached from ``import ckptfmt``)."""
    return any(path == package or path.startswith(f"{package}.") for package in PACKAGES)


def documented_paths() -> set[str]:
    """Every dotted ``ckptfmt...`` name in README.md, docs/**/*.md and spec/*.md (files and entry points aside)."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md"), *(ROOT / "spec").glob("*.md")]
    texts = [path.read_text() for path in files]
    found = {m for text in texts for m in re.findall(r"\bckptfmt(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text)}
    return found - NOT_ATTRIBUTES

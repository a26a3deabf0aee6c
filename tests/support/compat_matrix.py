"""The measured compatibility table of docs/compatibility.md: which ckptfmt reads what which writer wrote.

    .venv/bin/python -m tests.support.compat_matrix            # prints the table (Markdown), about 2 minutes

Writers: today's ckptfmt at its default (2.0) and with ``format_version=`` 1.0, 1.6, 1.11, 1.15 (each the
rich state tests/format/test_version_matrix.py saves), and the ckptfmt of the commits that introduced 1.6,
1.11 and 1.14 at their own default (their repositories of tests/corpus). Readers: the ckptfmt of the commit
that introduced each version 1.0-1.15 (tests/support/old_trees.py), and today's. Each reader lists,
verifies and loads every checkpoint of each repository, and a cell says what it found: "reads
bit-exactly" (every tensor and plain value as saved), "refuses" (an UnsupportedVersionError that says to
upgrade) or "fails" (any other error, or a value that differs), the message numbered below the table.
Needs the repository's history (the old commits).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import ckptfmt
from tests.corpus.generate import VERSIONS
from tests.format.test_version_matrix import CORPUS, cell, corpus_written, read_everywhere, save_floor
from tests.support.old_trees import ROOT

#: Today's writer: a column's label and its format_version= (None: the default).
TODAY = [("today, default (2.0)", None), *((f'today, format_version="{v}"', v) for v in ("1.0", "1.6", "1.11", "1.15"))]
#: Old trees whose own writer's repository (tests/corpus) is a column.
OLD_WRITERS = ("1.6", "1.11", "1.14")
#: Every reader: the old trees, then today's ckptfmt.
READERS = [*VERSIONS, "today"]


def measure(scratch: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The writers' labels, and each reader's cells (one per writer, in that order)."""
    key = scratch / "signing.pem"
    ckptfmt.generate_key(key)
    writers, repos = [], []
    for label, version in TODAY:
        repo = scratch / f"today-{version or 'default'}"
        writers.append(label)
        repos.append((repo, save_floor(version, repo, key)))
    for version in OLD_WRITERS:
        repo = scratch / f"tree-{version}"
        shutil.copytree(CORPUS / f"v{version}" / "repo", repo)  # a copy: a reader never touches the corpus
        writers.append(f"{version} tree, its default ({version})")
        repos.append((repo, corpus_written(version)))
    found = read_everywhere(READERS, repos)
    cells = {reader: [shorten(cell(result, saved), repo) for result, (repo, saved) in zip(found[reader], repos)]
             for reader in READERS}
    return writers, cells


def shorten(text: str, repo: Path) -> str:
    """A cell's message without the scratch folder or a manifest's hash (which differ between runs), cut to
    its first line."""
    text = text.replace(f"{repo}/", "").replace(str(repo), "REPO").splitlines()[0][:240]
    return re.sub(r"manifest-[0-9a-f]{64}\.msgpack", "manifest-HASH.msgpack", text)


def markdown(writers: list[str], cells: dict[str, list[str]]) -> str:
    """The table: a row per reader, a column per writer; refusals and failures as numbered notes."""
    notes: dict[str, int] = {}

    def short(text: str) -> str:
        if text == "reads bit-exactly":
            return text
        kind, _, message = text.partition(": ")
        number = notes.setdefault(message, len(notes) + 1)
        return f"{kind} [{number}]"

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    lines = [f"Measured {datetime.now(timezone.utc):%Y-%m-%d} at commit {commit.stdout.strip()} by "
             "`python -m tests.support.compat_matrix`.", "",
             "| reader \\ writer | " + " | ".join(writers) + " |", "|---" * (len(writers) + 1) + "|"]
    for reader in READERS:
        label = "today (2.0)" if reader == "today" else f"{reader} tree"
        lines.append(f"| {label} | " + " | ".join(short(text) for text in cells[reader]) + " |")
    lines.append("")
    lines += [f"[{number}] {escape(message)}  " for message, number in notes.items()]
    return "\n".join(lines).rstrip() + "\n"


def escape(text: str) -> str:
    return re.sub(r"([|*_<>])", r"\\\1", text)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="compat-matrix-") as scratch:
        writers, cells = measure(Path(scratch))
    sys.stdout.write(markdown(writers, cells))


if __name__ == "__main__":
    main()

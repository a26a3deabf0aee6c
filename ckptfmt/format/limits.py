"""Limits and naming rules that every reader applies before trusting a file.

They bound memory and time whatever a file claims, and forbid names that could
escape the repository (path traversal) on any filesystem or object store.
"""

from __future__ import annotations

import re
from typing import Any, TypeGuard

from ckptfmt.errors import InvalidNameError, ManifestError, quoted

MAX_MANIFEST_BYTES = 256 * 2**20
MAX_COMMIT_BYTES = 64 * 2**10
MAX_MARKER_BYTES = 64 * 2**10
#: One pack of the commit index (spec 4.4): about 40,000 commit records.
MAX_INDEX_PACK_BYTES = 16 * 2**20
MAX_DIMS = 64
MAX_KEY_BYTES = 4096
MAX_NAME_LENGTH = 128
MAX_NESTING = 256
#: Maps and arrays inside a manifest's run metadata (environment, rng, topology, timing, ...).
MAX_METADATA_NESTING = 64
MAX_TENSORS = 2_000_000
#: Chunk rows (1.13: 2^22, was 10,000,000; no manifest of rows within MAX_MANIFEST_BYTES holds more, about
#: 100 bytes a row, while columns, 41, would make a reader build 10 million rows: 2.5 GB of them).
MAX_CHUNKS = 2**22
MAX_SHARDS_PER_TENSOR = 1_000_000
#: Shards and pieces of all tensors together: what one manifest may ask a reader to check.
MAX_SHARDS = 2**24
MAX_PIECES = 2**24
#: Dimensions of shard maps (spec 6.5) in one manifest, all tensors together; shard grids do not count.
MAX_SHARD_MAP_DIMS = 2**22
MAX_CHUNK_BYTES = 4 * 2**30
#: Bases a delta chunk may be decoded through (spec 5.5): a reader holds that many chunks at once.
MAX_DELTA_DEPTH = 16
MAX_TENSOR_BYTES = 2**48

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
HASH_PATTERN = re.compile(r"[0-9a-f]{64}")
#: Names that a checkpoint may not take because the repository uses them.
RESERVED_NAMES = frozenset({"chunks", "ckptfmt.json"})


def is_valid_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` may name a checkpoint (spec 4.2).

    Reserved names compare case-insensitively: 'Chunks' is 'chunks' on macOS and Windows.
    """
    return isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None and name.lower() not in RESERVED_NAMES


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid checkpoint name, else raise InvalidNameError."""
    if not is_valid_name(name):
        raise InvalidNameError(
            f"invalid checkpoint name {quoted(name)}: use 1-{MAX_NAME_LENGTH} characters from "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit, not 'chunks' or 'ckptfmt.json'"
        )
    return name


def check_hash(value: object) -> str:
    """Return ``value`` if it is a lowercase hex BLAKE3-256 digest, else raise InvalidNameError."""
    if not isinstance(value, str) or not HASH_PATTERN.fullmatch(value):
        raise InvalidNameError(f"invalid chunk hash {quoted(value)}: expected 64 lowercase hex digits")
    return value


_MAX_INT = 2**63 - 1


def check_int(value: Any, what: str, low: int = 0, high: int = _MAX_INT) -> int:
    """``value`` if it is an int (not a bool) in [low, high]; else ManifestError naming ``what``."""
    if type(value) is not int or not low <= value <= high:
        raise ManifestError(f"{what} must be an integer in [{low}, {high}], found {quoted(value)}")
    return value


def all_ints(values, low: int = 0, high: int = _MAX_INT) -> bool:
    """Whether every value is an int (not a bool) in [low, high], checked with builtins over the whole
    list (a manifest's lists may hold millions)."""
    return not values or (set(map(type, values)) <= {int} and min(values) >= low and max(values) <= high)

"""The format's version (spec 13): what writers write, and the rule every reader applies to every object
that carries one (marker, manifest, commit record, index pack, lease, signature, history, copy record)."""

from __future__ import annotations

from typing import Any

from ckptfmt.errors import ManifestError, UnsupportedVersionError, quoted

#: The version of the format this ckptfmt writes unless told to write for an older reader: [major, minor].
FORMAT_VERSION = (2, 1)

#: The oldest version it reads: every version since is read forever (spec 13).
OLDEST_READ = (1, 0)

#: The last minor of format 1, whose objects format-2 readers read by their types (spec 13.1).
LAST_1X = (1, 15)


def check_version(version: Any, what: str) -> tuple[int, int]:
    """Accept format 1.x and 2.x (fields of newer minors are ignored); refuse a newer major as "upgrade"."""
    if not isinstance(version, list) or len(version) != 2 or not all(type(v) is int for v in version):
        raise ManifestError(f"{what}: malformed version {quoted(version)}")
    if not OLDEST_READ[0] <= version[0] <= FORMAT_VERSION[0] or version[1] < 0:
        raise UnsupportedVersionError(
            f"{what}: format version {version[0]}.{version[1]} is not readable by this ckptfmt "
            f"(reads {OLDEST_READ[0]}.x-{FORMAT_VERSION[0]}.x): written by a newer ckptfmt; upgrade to read it"
        )
    return version[0], version[1]


def writable(version: tuple[int, int]) -> tuple[int, int]:
    """``version`` if this ckptfmt can write for it (1.0-1.15 and 2.0 to its own), else a ValueError."""
    if not (OLDEST_READ <= version <= LAST_1X or (FORMAT_VERSION[0], 0) <= version <= FORMAT_VERSION):
        raise ValueError(f"cannot write format {version[0]}.{version[1]}: this ckptfmt writes "
                         f"{OLDEST_READ[0]}.{OLDEST_READ[1]}-{LAST_1X[0]}.{LAST_1X[1]} and "
                         f"{FORMAT_VERSION[0]}.0-{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}")
    return version

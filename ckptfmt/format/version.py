"""The format's version (spec 13): what writers write, and the rule every reader applies to every object
that carries one (marker, manifest, commit record, index pack, lease, signature)."""

from __future__ import annotations

from typing import Any

from ckptfmt.errors import ManifestError, UnsupportedVersionError, quoted

#: The version of the format this ckptfmt writes: [major, minor].
FORMAT_VERSION = (1, 15)


def check_version(version: Any, what: str) -> tuple[int, int]:
    """Accept any 1.x version (unknown fields of newer minors are ignored); refuse other majors."""
    if not isinstance(version, list) or len(version) != 2 or not all(type(v) is int for v in version):
        raise ManifestError(f"{what}: malformed version {quoted(version)}")
    if version[0] != FORMAT_VERSION[0]:
        raise UnsupportedVersionError(
            f"{what}: format version {version[0]}.{version[1]} is not readable by this ckptfmt "
            f"(reads {FORMAT_VERSION[0]}.x); upgrade ckptfmt"
        )
    return version[0], version[1]

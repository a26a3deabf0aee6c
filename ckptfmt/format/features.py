"""Required features (spec 13.2): every form of the format that a reader must implement to read an object,
named, with the version that brought it.

A format-2 object lists the features it uses in ``requires``; a reader refuses one it does not know before
it parses anything else, so a newer writer's object reads as "upgrade", never as damage. A writer asked to
write for an older version (``format_version=``) may use only the features that version has.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptfmt.errors import ManifestError, UnsupportedVersionError, quoted
from ckptfmt.format.version import check_version


@dataclass(frozen=True)
class Feature:
    """One required feature: its name in ``requires``, the version that brought it, and what it is."""

    name: str
    since: tuple[int, int]
    what: str


#: Every feature this ckptfmt reads, oldest first (spec 13.2's table).
FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("per-rank-values", (1, 1), "per-rank values in the value tree (extension 13, spec 7.2)"),
    Feature("delta-codecs", (1, 5), "chunks stored as XOR deltas against a base chunk, spec 5.5"),
    Feature("shard-grids", (1, 6), "a tensor's shards as a grid map, spec 6.11"),
    Feature("node-placement", (1, 10), "chunks held on each node's own storage, spec 9.8"),
    Feature("float-codecs", (1, 11), "the float plane codecs floatN-zstd and floatdeltaN-zstd, spec 5.3"),
    Feature("tensor-columns", (1, 12), "the tensor table in columns, spec 6.12"),
    Feature("chunk-columns", (1, 13), "the chunk table in columns, spec 6.13"),
    Feature("rng-words", (1, 13), "Python generator states as a bin of 625 words, spec 9.1"),
    Feature("grid-columns", (1, 14), "shard grids in the tensor columns, spec 6.12"),
    Feature("ml-dsa-65", (2, 0), "ML-DSA-65 signatures (FIPS 204), spec 10.3"),
    Feature("ed25519+ml-dsa-65", (2, 0), "hybrid Ed25519 and ML-DSA-65 signatures, both verified, spec 10.3"),
    Feature("parity", (2, 1), "Reed-Solomon parity records that rebuild lost or damaged objects, spec 5.6"),
    Feature("node-parity", (2, 1), "parity across a node-scoped checkpoint's nodes, spec 9.8"),
)}


#: Unknown features an error names; the rest are counted (a hostile object may list millions).
_NAMED = 5


def parse_version(text: str) -> tuple[int, int]:
    """``"1.6"`` as ``(1, 6)``; anything else is a ValueError naming what is accepted."""
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"format version {text!r} is not MAJOR.MINOR (for example 1.11)")
    return int(major), int(minor)


def version_text(version: Iterable[int]) -> str:
    return ".".join(map(str, version))


def first_version(name: str) -> tuple[int, int]:
    """The first format version that has feature ``name``."""
    return FEATURES[name].since


def refuse_unless_writable(name: str, target: tuple[int, int], option: str) -> None:
    """A ValueError when a write for format ``target`` needs feature ``name`` (asked for by ``option``)."""
    since = FEATURES[name].since
    if target < since:
        raise ValueError(f"{option} needs format {version_text(since)} ({FEATURES[name].what}); "
                         f"format {version_text(target)} cannot express it")


def requires_doc(used: Iterable[str]) -> list[str]:
    """The ``requires`` member of an object that uses ``used``: known names, sorted, each once."""
    names = sorted(set(used))
    for name in names:
        if name not in FEATURES:
            raise ValueError(f"unknown feature {name!r}")
    return names


def version_fields(version: tuple[int, int], used: Iterable[str] = ()) -> dict:
    """The ``version`` (and, from format 2, ``requires``) members of an object written for ``version``."""
    if version[0] < 2:
        return {"version": list(version)}
    return {"version": list(version), "requires": requires_doc(used)}


def check_object(doc: dict, what: str) -> tuple[tuple[int, int], frozenset[str]]:
    """An object's version and required features, checked (spec 13) before anything else of it is read."""
    version = check_version(doc.get("version"), what)
    return version, check_requires(doc, version, what)


def check_requires(doc: dict, version: tuple[int, int], what: str) -> frozenset[str]:
    """The features a format-2 object ``doc`` requires, refusing unknown ones as newer; a 1.x object
    requires nothing it declares (its forms are read by their types, spec 13.1)."""
    if version[0] < 2:
        return frozenset()
    raw = doc.get("requires")
    if not isinstance(raw, list) or not all(type(name) is str for name in raw) or len(set(raw)) != len(raw):
        raise ManifestError(f"{what}: 'requires' must be an array of distinct strings, not {quoted(raw)}")
    unknown = sorted(set(raw) - FEATURES.keys())
    if unknown:
        more = f" and {len(unknown) - _NAMED} more" if len(unknown) > _NAMED else ""
        named = ", ".join(map(repr, unknown[:_NAMED])) + more
        raise UnsupportedVersionError(f"{what} requires {named}: written by a newer ckptfmt; upgrade to read it")
    return frozenset(raw)


def check_declared(used: Iterable[str], declared: frozenset[str], version: tuple[int, int], what: str) -> None:
    """A format-2 object that uses a feature it does not declare is malformed: a reader that implements
    only some features must be able to trust ``requires``."""
    if version[0] < 2:
        return
    missing = sorted(set(used) - declared)
    if missing:
        raise ManifestError(f"{what} uses {', '.join(missing)} without declaring it in 'requires'")


__all__ = ["FEATURES", "Feature", "check_declared", "check_object", "check_requires", "first_version", "parse_version",
           "refuse_unless_writable", "requires_doc", "version_fields", "version_text"]

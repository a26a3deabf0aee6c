"""Progress objects (spec 4.6, 1.9): the steps a process computed since its last save, kept as it goes.

A checkpoint's manifest holds the steps up to its save; a process killed between
saves takes the steps it computed since with it, and with them the moment it
stopped. So that an analysis can tell how much work a failure cost and when it
struck (``ckptfmt goodput``), a ``StepTimer`` bound to a repository rewrites one
small object of its own (per process, rank and timer) as it trains:
``REPO/_progress/<started_ns>.<rank>.<pid>.msgpack``, a msgpack map holding the
process's identity, the steps it has not saved yet and the times saves held its
loop that no save stored yet (spec 9.4's ``steps`` and ``stalls``), and (1.15) its
resumes no save stored yet (spec 9.4's ``resumes``), written the moment it resumes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgpack

from ckptfmt.errors import ManifestError, quoted
from ckptfmt.format.features import version_fields
from ckptfmt.format.layout import PROGRESS_DIR
from ckptfmt.format.limits import MAX_MANIFEST_BYTES
from ckptfmt.format.maps import unpack_object
from ckptfmt.format.version import FORMAT_VERSION

PROGRESS_FORMAT = "ckptfmt-progress"
#: A progress object holds at most what a manifest may.
MAX_PROGRESS_BYTES = MAX_MANIFEST_BYTES
_KEY = re.compile(r"(\d{19})\.(\d{1,10})\.(\d{1,10})\.msgpack")


@dataclass(frozen=True)
class ProgressKey:
    """A progress object's name: when its writer started keeping it, the rank, the process id."""

    started_ns: int
    rank: int
    pid: int

    @property
    def key(self) -> str:
        return f"{PROGRESS_DIR}/{self.started_ns:019d}.{self.rank}.{self.pid}.msgpack"

    @classmethod
    def parse(cls, entry: str) -> ProgressKey | None:
        """The parts of an entry listed under ``_progress/``, or None for anything else (ignored)."""
        match = _KEY.fullmatch(entry)
        return None if match is None else cls(int(match[1]), int(match[2]), int(match[3]))


@dataclass(frozen=True)
class Progress:
    """One process's progress: who wrote it, when, and the steps it had not saved then."""

    started_ns: int
    rank: int
    pid: int
    host: str
    written_ns: int
    #: The steps since the process's last save, as spec 9.4's ``steps`` map (None: none).
    steps: dict | None
    #: The times saves held its loop not yet stored by a save, as spec 9.4's ``stalls`` (None: none).
    stalls: dict | None = None
    #: Its resumes not yet stored by a save (1.15), as spec 9.4's ``resumes`` records (None: none).
    resumes: list[dict] | None = None

    def to_bytes(self, version: tuple[int, int] = FORMAT_VERSION) -> bytes:
        """The stored form, for readers of ``version`` (its repository's marker's)."""
        return msgpack.packb({"format": PROGRESS_FORMAT, **version_fields(version),
                              "started_ns": self.started_ns, "rank": self.rank, "pid": self.pid,
                              "host": self.host, "written_ns": self.written_ns, "steps": self.steps,
                              "stalls": self.stalls, **({"resumes": self.resumes} if self.resumes else {})},
                             use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, expected: ProgressKey, where: str) -> Progress:
        """Parse a progress object read at ``expected``'s key: its identity must match the key."""
        doc = unpack_object(data, where, PROGRESS_FORMAT, MAX_PROGRESS_BYTES)
        identity = (doc.get("started_ns"), doc.get("rank"), doc.get("pid"))
        if identity != (expected.started_ns, expected.rank, expected.pid):
            raise ManifestError(f"{where}: its started_ns, rank and pid ({', '.join(map(quoted, identity))}) "
                                "differ from its key's")
        host, written, steps = doc.get("host"), doc.get("written_ns"), doc.get("steps")
        if not isinstance(host, str) or type(written) is not int:
            raise ManifestError(f"{where}: host or written_ns missing")
        stalls, resumes = doc.get("stalls"), doc.get("resumes")
        if steps is not None and not isinstance(steps, dict) or stalls is not None and not isinstance(stalls, dict):
            raise ManifestError(f"{where}: steps or stalls is not a map")
        if resumes is not None and not (isinstance(resumes, list) and all(isinstance(r, dict) for r in resumes)):
            raise ManifestError(f"{where}: resumes is not an array of maps")
        return cls(expected.started_ns, expected.rank, expected.pid, host, written, steps, stalls, resumes or None)

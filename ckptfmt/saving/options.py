"""``SaveOptions``: every option of a save, checked once, shared by every way of saving.

``ckptfmt.save`` and ``ckptfmt.async_save`` take these as keywords and build one;
``CheckpointManager`` builds one when it is made, so a misspelt or bad option
fails there and not at the first save hours later. The front-ends (the
single-process save, the collective save, the DCP storage writer) read them
from here instead of passing a dozen arguments along.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ckptfmt.errors import ManifestError, UnsupportedValueError
from ckptfmt.format import codecs
from ckptfmt.format.features import first_version, parse_version, refuse_unless_writable, version_text
from ckptfmt.format.limits import MAX_CHUNK_BYTES
from ckptfmt.format.signatures import SigningKey, signature_features
from ckptfmt.format.version import FORMAT_VERSION, writable
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.repository.protection import parse_parity


class _Latest:
    """The default parent: the repository's latest committed checkpoint when the save starts."""

    def __repr__(self) -> str:
        return "LATEST"


#: ``parent=LATEST`` (the default): the repository's latest checkpoint, whichever it is then.
LATEST = _Latest()
#: How long a collective save waits for every rank at each of its steps.
DEFAULT_TIMEOUT_S = 600.0
#: What a collective save does when the copies of a replicated tensor differ (``on_divergence``).
DIVERGENCE_POLICIES = ("warn", "raise", "ignore")
#: Where a repository's storage is: one every rank sees, or each node's own (spec 9.8).
SCOPES = ("job", "node")
#: The version that brought signatures (spec 10.3): optional objects, not a required feature.
SIGNATURES_FROM = (1, 7)
#: Chunk writer threads per rank: they overlap hashing with other chunks' writes and fsyncs; on
#: remote storage each holds a copy of its chunk, so 4 x 64 MiB bounds the memory.
DEFAULT_WORKERS = 4



def target_version(value: Any) -> tuple[int, int]:
    """``format_version=`` as a (major, minor) this ckptfmt writes: None for its own, "1.6", or (1, 6)."""
    if value is None:
        return FORMAT_VERSION
    if isinstance(value, str):
        version = parse_version(value)
    elif isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value):
        version = value
    else:
        raise TypeError(f"format_version must be a string such as '1.6' or a (major, minor) pair, not {value!r}")
    return writable(version)


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How to save a checkpoint; every field is a keyword of ``ckptfmt.save`` (see its docstring)."""

    #: The training step, stored in the commit record (a plain int once checked).
    step: int | None = None
    #: The user's plain values, stored under ``user`` in the manifest.
    metadata: dict | None = None
    #: fsspec options of the repository's storage (S3 endpoint, credentials).
    storage_options: dict | None = None
    #: The parent checkpoint's name, None for none, or LATEST.
    parent: Any = LATEST
    #: Bytes per chunk (4 KiB to the format's limit); None: the default.
    chunk_size: int | None = None
    #: One of ``format.codecs.COMPRESSIONS``: None or "none" (stored as is), "zstd", "shuffle-zstd" (bytes
    #: grouped by significance first), "float-zstd" (floating-point tensors' sign and exponent apart from
    #: their mantissa), "delta-zstd" (against the parent's chunk), "auto" (chosen per tensor).
    compression: str | None = None
    #: The caller's own per-step timings, stored under ``timing.steps``.
    step_times: list | None = None
    #: The run's parallelism degrees, e.g. ``{"dp": 8, "tp": 2}``.
    parallelism: dict | None = None
    #: Chunk writer threads per rank; None: ``DEFAULT_WORKERS``.
    workers: int | None = None
    #: Per-rank RNG entries recorded by another tool (converters), replacing this process's states.
    rng: list | None = None
    #: Where an imported checkpoint came from (converters).
    provenance: dict | None = None
    #: Called once every chunk is durable, just before the commit; raising stops the save.
    before_commit: Callable[[], None] | None = None
    #: The process group a collective save runs over (None: the default group, if any).
    process_group: Any = None
    #: False: save this process's state alone even under torch.distributed; True: insist on a collective save.
    coordinated: bool | None = None
    #: Seconds a collective save waits for every rank at each of its steps.
    timeout: float = DEFAULT_TIMEOUT_S
    #: Take each tensor's statistics (spec 6.10) as its bytes are hashed, and store them in the manifest.
    tensor_stats: bool = True
    #: A collective save compares the copies of every replicated tensor (spec 9.7): ``"warn"`` records
    #: and warns of copies that differ, ``"raise"`` fails the save instead, ``"ignore"`` compares nothing.
    on_divergence: str = "warn"
    #: Every rank's training steps, gathered for a save that one rank makes (a framework that writes
    #: from rank 0): ``[{"rank", "host", "steps": StepTimer.snapshot()}]`` (``distributed.steps.gather_steps``).
    gathered_steps: list | None = None
    #: Sign the checkpoint (spec 10.3) with this private key (Ed25519; ML-DSA-65 or hybrid from format 2.0): a
    #: PEM file (``ckptfmt keygen``), ``cryptography`` keys or a ``SigningKey``; loaded once, here. The key never
    #: enters the repository.
    signer: Any = None
    #: ``"job"``: the repository is one storage every rank sees; ``"node"``: the URL names each node's own
    #: storage (a node-local disk), which holds the boxes of that node's ranks (spec 9.8).
    scope: str = "job"
    #: Write for readers of this format version (spec 13.3): ``"1.6"`` or ``(1, 6)``; None: this ckptfmt's own.
    #: Options that version cannot express are refused, naming the version that first has them.
    format_version: Any = None
    #: Reed-Solomon parity written with the checkpoint (spec 5.6, 2.1), ``"K+M"`` such as ``"8+2"``: any M lost
    #: or damaged objects of each stripe of K then rebuild (``ckptfmt repair``) with no replica. None: none.
    parity: str | None = None

    def __post_init__(self) -> None:
        step = self.step
        if step is not None:
            if isinstance(step, bool) or not hasattr(step, "__index__"):
                raise TypeError(f"step must be an integer or None, not {type(step).__name__}")
            object.__setattr__(self, "step", operator.index(step))  # numpy and 0-d integer tensors too
        if self.chunk_size is not None and not (isinstance(self.chunk_size, int) and
                                                4096 <= self.chunk_size <= MAX_CHUNK_BYTES):
            raise ValueError(f"chunk_size must be between 4096 and {MAX_CHUNK_BYTES} bytes")
        codecs.codec_for(self.compression, 4)
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ValueError(f"workers must be a positive integer or None, not {self.workers!r}")
        if self.rng is not None and not (isinstance(self.rng, list) and all(isinstance(e, dict) for e in self.rng)):
            raise TypeError("rng must be a list of per-rank dicts")
        for name in ("step_times", "parallelism", "rng", "provenance"):
            try:
                msgpack.packb(getattr(self, name), use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as exc:
                raise UnsupportedValueError(
                    f"{name} must hold plain values (numbers, strings, lists, dicts): {exc}") from None
        if self.before_commit is not None and not callable(self.before_commit):
            raise TypeError("before_commit must be a callable or None")
        if self.on_divergence not in DIVERGENCE_POLICIES:
            raise ValueError(f"on_divergence must be one of {', '.join(DIVERGENCE_POLICIES)}, "
                             f"not {self.on_divergence!r}")
        if not isinstance(self.tensor_stats, bool):
            raise TypeError(f"tensor_stats must be True or False, not {self.tensor_stats!r}")
        if self.coordinated not in (None, True, False):
            raise TypeError(f"coordinated must be True, False or None, not {self.coordinated!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError("timeout must be a positive number of seconds")
        if self.gathered_steps is not None:
            check_gathered_steps(self.gathered_steps)
        if self.signer is not None:
            object.__setattr__(self, "signer", SigningKey.load(self.signer))
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {self.scope!r}")
        object.__setattr__(self, "format_version", target_version(self.format_version))
        self._refuse_what_the_version_lacks()
        if self.parity is not None:
            parse_parity(self.parity)
            if self.scope == "node":
                raise ValueError("parity= protects a checkpoint whose objects one storage holds; a node-scoped "
                                 "tier's nodes each hold their own: give its Tier redundancy instead")
        if self.scope == "node" and self.compression in codecs.DELTA_COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r} stores chunks against the parent's, which a "
                             "node-scoped repository does not promise to hold on the same node: use 'zstd', "
                             "'shuffle-zstd', 'float-zstd' or none with scope='node'")

    def _refuse_what_the_version_lacks(self) -> None:
        """A ValueError for an option the target format cannot express ("auto" compression picks within it)."""
        version = self.format_version
        if self.compression == "float-zstd":
            refuse_unless_writable("float-codecs", version, "compression='float-zstd'")
        if self.compression == "delta-zstd":
            refuse_unless_writable("delta-codecs", version, "compression='delta-zstd'")
        if self.scope == "node":
            refuse_unless_writable("node-placement", version, "scope='node'")
        if self.signer is not None and version < SIGNATURES_FROM:
            raise ValueError(f"signer= needs format {version_text(SIGNATURES_FROM)} (signatures, spec 10.3); "
                             f"format {version_text(version)} cannot express it")
        for feature in signature_features(self.signer.algorithm) if self.signer is not None else ():
            refuse_unless_writable(feature, version, f"signer= (an {self.signer.algorithm} key)")  # ML-DSA: 2.0
        if self.parity is not None:
            refuse_unless_writable("parity", version, "parity=")

    @property
    def marker_features(self) -> frozenset[str]:
        """The required features every manifest of this save uses (spec 13.2), which a repository it creates
        declares at once: the tables in columns, RNG words where RNG states are taken, placement. A save
        that needs more (grids, a codec) adds them before its commit (``Repository.declare``)."""
        if self.format_version[0] < 2:
            return frozenset()
        return frozenset({"tensor-columns", "chunk-columns", *(["rng-words"] if self.rng is None else []),
                          *(["node-placement"] if self.scope == "node" else [])})

    @property
    def float_codecs(self) -> bool:
        """Whether the target format has the float codecs ("auto" uses them only then)."""
        return self.format_version >= first_version("float-codecs")

    @property
    def delta_codecs(self) -> bool:
        """Whether the target format has delta chunks ("auto" and "delta-zstd" store against the parent only then)."""
        return self.format_version >= first_version("delta-codecs")

    @property
    def stores_deltas(self) -> bool:
        """Whether this save stores chunks against the parent's where that is smaller: its compression
        asks for it and its format has delta chunks (the one place that choice is made)."""
        return self.compression in codecs.DELTA_COMPRESSIONS and self.delta_codecs

    @classmethod
    def from_keywords(cls, caller: str, keywords: dict[str, Any]) -> SaveOptions:
        """Options from a call's keywords; an unknown one is named with the function it was given to."""
        unknown = sorted(set(keywords) - _FIELDS)
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        return cls(**keywords)

    @property
    def chunk_workers(self) -> int:
        """The chunk writer threads to use."""
        return self.workers or DEFAULT_WORKERS

    def replace(self, **changes: Any) -> SaveOptions:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


_FIELDS = frozenset(field.name for field in dataclasses.fields(SaveOptions))


def check_gathered_steps(gathered: object) -> None:
    """Refuse gathered step records that are not one well-formed entry per distinct rank."""
    if not isinstance(gathered, list):
        raise TypeError("gathered_steps must be a list of {'rank', 'host', 'steps'} entries")
    ranks = set()
    for index, entry in enumerate(gathered):
        where = f"gathered_steps[{index}]"
        if not (isinstance(entry, dict) and {"rank", "host", "steps"} <= set(entry) <= {"rank", "host", "steps",
                                                                                        "resumes"}):
            raise TypeError(f"{where} must be a dict with the keys rank, host and steps (and resumes)")
        resumes = entry.get("resumes", [])
        if not (isinstance(resumes, list) and all(isinstance(r, dict) for r in resumes)):
            raise TypeError(f"{where}: resumes must be a list of resume records (maps)")
        rank = entry["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or rank in ranks:
            raise ValueError(f"{where}: rank must be a distinct non-negative integer, not {rank!r}")
        ranks.add(rank)
        if not isinstance(entry["host"], str):
            raise TypeError(f"{where}: host must be a string")
        try:
            decode_steps(entry["steps"], where)
        except ManifestError as exc:
            raise ValueError(f"{exc} (steps must be a StepTimer.snapshot())") from None

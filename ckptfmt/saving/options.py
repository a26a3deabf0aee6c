"""``SaveOptions``: every option of a save, checked once, shared by every way of saving.

``ckptfmt.save`` and ``ckptfmt.async_save`` take these as keywords and build one;
``CheckpointManager`` builds one when it is made, so a misspelt or bad option
fails there and not at the first save hours later. The front-ends (the
single-process save, the collective save, the DCP storage writer) read them
from here instead of passing a dozen arguments along.
"""

from __future__ import annotations

import dataclasses
import functools
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
from ckptfmt.saving.chunker import DEFAULT_CHUNK_SIZE


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
#: The compressions that name a codec a format version may lack, and its feature ("auto" picks within it).
_CODEC_FEATURES = {"float-zstd": "float-codecs", "delta-zstd": "delta-codecs"}


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
class Encoding:
    """How a save stores its chunks: the part of its options the chunk writer reads (``SaveOptions.encoding``),
    with each choice a compression implies decided here, once."""

    #: One of ``format.codecs.COMPRESSIONS`` (checked by ``SaveOptions``).
    compression: str | None = None
    #: Bytes per chunk.
    chunk_size: int = DEFAULT_CHUNK_SIZE
    #: Chunk writer threads.
    workers: int = DEFAULT_WORKERS
    #: Take each tensor's statistics (spec 6.10) as its bytes are hashed.
    tensor_stats: bool = True
    #: Whether the target format has the float codecs (1.11) and delta chunks (1.5) (spec 13.3).
    float_codecs: bool = True
    delta_codecs: bool = True

    @property
    def chooses_per_chunk(self) -> bool:
        """Whether each chunk's codec is chosen from its bytes ("delta-zstd", "auto"): a private copy is
        encoded whole and, where the parent has a chunk for its region, against it, and the smaller kept."""
        return self.compression in codecs.DELTA_COMPRESSIONS

    @property
    def stores_deltas(self) -> bool:
        """Whether chunks are stored against the parent's where that is smaller: the compression asks for
        it and the format has delta chunks (the one place that choice is made)."""
        return self.chooses_per_chunk and self.delta_codecs

    @property
    def weighs_codecs(self) -> bool:
        """Whether each chunk's codec is weighed against the others ("auto"): the float codec against the
        shuffle on a sample, and raw bytes where compression saves less than 10%."""
        return self.compression == "auto"

    @property
    def float_coded(self) -> bool:
        """Whether floating-point tensors (and packs of small tensors of one float dtype, spec 5.2) are
        stored with the float codecs: the compression asks for them ("float-zstd", "auto") and the format
        has them."""
        return self.float_codecs and self.compression in codecs.FLOAT_COMPRESSIONS


@dataclass(frozen=True, kw_only=True)
class Group:
    """Who saves together and how they agree: the part of a save's options the choice of ranks and the
    collective protocol read (``SaveOptions.group``)."""

    #: The process group (None: the default group, if any).
    process_group: Any = None
    #: None: collective under torch.distributed; False: this process alone; True: collective or an error.
    coordinated: bool | None = None
    #: Seconds a collective save waits for every rank at each of its steps.
    timeout: float = DEFAULT_TIMEOUT_S
    #: One of ``DIVERGENCE_POLICIES``.
    on_divergence: str = "warn"
    #: Every rank's steps, for a save one rank makes (``SaveOptions.gathered_steps``).
    gathered_steps: list | None = None

    @property
    def alone(self) -> bool:
        """Whether this process saves alone whatever process group there is (``coordinated=False``)."""
        return self.coordinated is False

    @property
    def needs_group(self) -> bool:
        """Whether a save with no process group to run over is an error (``coordinated=True``)."""
        return self.coordinated is True

    @property
    def compares_replicas(self) -> bool:
        """Whether a collective save compares the copies of each replicated tensor (spec 9.7): unless
        ``on_divergence="ignore"``."""
        return self.on_divergence != "ignore"

    @property
    def refuses_divergence(self) -> bool:
        """Whether copies that differ fail the save on every rank (``on_divergence="raise"``) rather than
        being recorded and warned of."""
        return self.on_divergence == "raise"

    def steps_of(self, rank: int) -> dict | None:
        """The gathered entry of ``rank`` (its ``steps`` and ``resumes``), or None."""
        return next((entry for entry in self.gathered_steps or () if entry["rank"] == rank), None)

    def steps_besides(self, rank: int) -> list[dict]:
        """The gathered entries of every rank but ``rank`` (the one saving, which records its own)."""
        return [entry for entry in self.gathered_steps or () if entry["rank"] != rank]


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How to save a checkpoint; every field is a keyword of ``ckptfmt.save`` (see its docstring).

    The fields are the keywords as given, flat as ``save`` takes them, each checked once; the parts of
    the save read them grouped, each choice decided once: ``encoding`` (how chunks are stored: the chunk
    writer's), ``group`` (who saves together and how they agree), and the predicates ``node_scoped``
    (where the repository is) and ``records_own_rng`` (an import's states or this process's).
    """

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
            if self.node_scoped:
                raise ValueError("parity= protects a checkpoint whose objects one storage holds; a node-scoped "
                                 "tier's nodes each hold their own: give its Tier redundancy instead")
        if self.node_scoped and self.encoding.chooses_per_chunk:
            raise ValueError(f"compression={self.compression!r} stores chunks against the parent's, which a "
                             "node-scoped repository does not promise to hold on the same node: use 'zstd', "
                             "'shuffle-zstd', 'float-zstd' or none with scope='node'")

    def _refuse_what_the_version_lacks(self) -> None:
        """A ValueError for an option the target format cannot express ("auto" compression picks within it)."""
        version = self.format_version
        if self.compression in _CODEC_FEATURES:
            refuse_unless_writable(_CODEC_FEATURES[self.compression], version, f"compression={self.compression!r}")
        if self.node_scoped:
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
        return frozenset({"tensor-columns", "chunk-columns", *(["rng-words"] if self.records_own_rng else []),
                          *(["node-placement"] if self.node_scoped else [])})

    @functools.cached_property
    def encoding(self) -> Encoding:
        """How this save stores its chunks, with what its target format has ("auto" uses the float codecs
        only where it has them; deltas are stored only where it has delta chunks)."""
        return Encoding(compression=self.compression, chunk_size=self.chunk_size or DEFAULT_CHUNK_SIZE,
                        workers=self.workers or DEFAULT_WORKERS, tensor_stats=self.tensor_stats,
                        float_codecs=self.format_version >= first_version("float-codecs"),
                        delta_codecs=self.format_version >= first_version("delta-codecs"))

    @functools.cached_property
    def group(self) -> Group:
        """Who saves together and how they agree."""
        return Group(process_group=self.process_group, coordinated=self.coordinated, timeout=self.timeout,
                     on_divergence=self.on_divergence, gathered_steps=self.gathered_steps)

    @property
    def node_scoped(self) -> bool:
        """Whether the repository's URL names each node's own storage (``scope="node"``, spec 9.8)."""
        return self.scope == "node"

    @property
    def records_own_rng(self) -> bool:
        """Whether the manifest records this process's RNG states (every rank's), rather than the entries
        an import was given (``rng=``, converters)."""
        return self.rng is None

    @classmethod
    def from_keywords(cls, caller: str, keywords: dict[str, Any]) -> SaveOptions:
        """Options from a call's keywords; an unknown one is named with the function it was given to."""
        unknown = sorted(set(keywords) - _FIELDS)
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        return cls(**keywords)

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

"""Does a run reproduce another bit for bit, and if not, from which step and why (issue 29, part 4).

``certify(reference, run)`` aligns the two runs' step signatures (spec 9.4: per
rank and step, the batch digest, every generator's digest at the step's start
and the loss's exact bits) over their common steps, rank by rank, and finds
the first step where one differs. Its cause, from what differs there:

- ``rng``: a generator's state differs at the step's start (one either run
  draws from: its digest changes between steps of one process);
- ``data``: the batch digests differ (a rank was fed other samples); where a
  generator differs too, it comes first (a loader shuffles from it) unless the
  resume before the step is on record as having restored the generators, or
  (with no record either way) the batch is one the reference was fed at an
  earlier step (repeated samples);
- otherwise the inputs agree and an output differs (the loss, the gradient
  norm, or this rank's gradients' norm: those both runs recorded), so the state the step
  started from differed: ``load`` where a resume of RUN before that step is
  on record as not restoring a part (spec 9.4 ``resumes``), ``hyperparameters``,
  ``topology`` or ``environment`` where the runs' checkpoints record such a
  difference (``compare``'s), else ``nondeterminism``.

Every candidate is listed with its evidence, the one named first. A step
computed twice in a run (after a resume from an older checkpoint) counts in
the branch the run went on with. The history of removed checkpoints is read
as well (spec 4.5).

``certify(run)`` alone certifies each resume of RUN against the checkpoint it
resumed from: its record of what the resume restored, and the steps the run
computed again, compared with the ones the original branch had recorded.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfmt.analytics.compare import compare
from ckptfmt.analytics.timings import saved_timings
from ckptfmt.errors import CheckpointError
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.repository.progress import read_progress
from ckptfmt.repository.repository import Repository
from ckptfmt.tools.formatting import world_sizes

VERDICTS = ("identical", "diverged", "undetermined")
#: Exit codes of ``ckptfmt certify`` by verdict.
EXIT_CODES = {"identical": 0, "diverged": 1, "undetermined": 2}
#: The metrics that sign a step's outputs (spec 9.4), compared where both runs recorded them: the loss
#: (the loop's, or a framework's hook), the gradient norm, and this rank's gradients' norm (the
#: integrations' optimizer hooks, where no hook sees the loss).
OUTPUTS = ("loss", "grad_norm", "grad_norm_local")
#: compare()'s kinds of difference -> certify's causes.
_CAUSE_OF_KIND = {"hyperparameters": "hyperparameters", "topology": "topology", "determinism": "environment",
                  "versions": "environment", "hardware": "environment", "environment": "environment",
                  "code": "environment"}


@dataclass(frozen=True)
class StepSignature:
    """One rank's step, as signed: what went in (batch, generators) and what came out (the bits of each
    output metric it recorded: ``OUTPUTS``)."""

    batch_kind: int
    batch: bytes | None
    rng: dict[str, bytes]
    outputs: dict[str, bytes]
    saved_ns: int  # when the save that recorded it was made (a progress object's: when it was written)
    start_ns: int  # when the step started: a computation recorded twice (a progress object, then a save) is one


@dataclass
class Cause:
    """A candidate cause of the first divergence, with the records that show it."""

    cause: str
    evidence: list[str]

    def to_json(self) -> dict:
        return {"cause": self.cause, "evidence": self.evidence}


@dataclass
class Certificate:
    """``certify``'s verdict (the JSON of ``ckptfmt certify --json``)."""

    reference: str
    run: str
    verdict: str
    steps_compared: int
    first_divergence: dict | None = None  # {"step", "ranks", "cause", "evidence"}
    causes: list[Cause] = field(default_factory=list)
    #: Why the verdict is undetermined: the record that is missing.
    missing: str | None = None
    #: A resume certified alone (``certify(run)``): the checkpoint it resumed from, and the resume's
    #: record (spec 9.4 ``resumes``: rank, checkpoint, world sizes, time, parts) for its lineage.
    resumed_from: str | None = None
    resume: dict | None = None

    def summary(self) -> str:
        """The verdict in words: over how many steps, where it diverged and why, or what is missing."""
        steps = f"{self.steps_compared} step{'s' * (self.steps_compared != 1)}"
        if self.verdict == "identical":
            return f"reproduces it bit for bit over {steps}"
        if self.verdict == "diverged" and self.first_divergence:
            first = self.first_divergence
            compared = f", after {steps} compared" if self.steps_compared else ""
            return f"diverges at step {first['step']} ({first['cause']}){compared}"
        return f"cannot tell: {self.missing}"

    def lineage(self) -> dict:
        """A resume's place in its run (``certify(run)``'s certificates): its rank, the checkpoint it
        came from and that one's step, the world size then and now, the seconds from that save to the
        resume, the parts it did not restore."""
        resume = self.resume or {}
        source = resume.get("from") or {}
        created, resumed = source.get("created_ns"), resume.get("resumed_ns")
        return {"rank": resume.get("rank"), "resumed_from": source.get("name"), "step": source.get("step"),
                "world_size": world_sizes(resume.get("world_size")),
                "after_s": (resumed - created) / 1e9 if type(created) is int and type(resumed) is int else None,
                "not_restored": [f"{part.get('part')} {part.get('verdict')}" for part in resume.get("parts") or []
                                 if part.get("verdict") != "equal"]}

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "steps_compared": self.steps_compared,
                "first_divergence": self.first_divergence, "causes": [c.to_json() for c in self.causes],
                "reference": self.reference, "run": self.run,
                **({"missing": self.missing} if self.missing else {}),
                **({"resumed_from": self.resumed_from} if self.resumed_from else {})}


class RunRecords:
    """A run's step signatures by (rank, step), and its resumes, from its manifests and history objects."""

    def __init__(self, url: str | os.PathLike, storage_options: dict | None = None):
        self.repo = Repository.open(url, storage_options)
        self.url, self.storage_options = self.repo.url, storage_options
        saves = saved_timings(self.repo)
        self.signatures: dict[tuple[int, int], StepSignature] = {}
        #: Every computation of a (rank, step), oldest first: a step computed again has several.
        self.branches: dict[tuple[int, int], list[StepSignature]] = {}
        self.resumes: list[dict] = []
        for saved_ns, timing in saves:
            for index, entry in enumerate((timing or {}).get("ranks") or []):
                if not isinstance(entry, dict):
                    continue
                rank = entry.get("rank")
                for resume in entry.get("resumes") or []:
                    if isinstance(resume, dict):
                        self.resumes.append({**resume, "saved_ns": saved_ns})
                if entry.get("steps") is not None and type(rank) is int:
                    self._add_steps(rank, entry["steps"], saved_ns, f"{self.url}: timing.ranks[{index}].steps")
        # The steps a process computed after its last save (a killed one's), and its resumes no save stored:
        # its progress object's (spec 4.6).
        stored = {resume.get("resumed_ns") for resume in self.resumes}
        for progress in read_progress(self.repo):
            if progress.steps is not None:
                self._add_steps(progress.rank, progress.steps, progress.written_ns,
                                f"{self.url}: progress of rank {progress.rank}")
            for resume in progress.resumes or []:
                if resume.get("resumed_ns") not in stored:
                    stored.add(resume.get("resumed_ns"))
                    self.resumes.append({**resume, "saved_ns": progress.written_ns})
        for key, branch in self.branches.items():  # each computation once (a save's record first), as they ran
            unique: dict[int, StepSignature] = {}
            for signature in branch:
                unique.setdefault(signature.start_ns, signature)
            self.branches[key] = sorted(unique.values(), key=lambda signature: signature.start_ns)
            self.signatures[key] = self.branches[key][-1]  # the branch the run went on with
        #: Per rank, the generators the run drew from: their digest changes from a step to the next one
        #: in the same process (no resume of the rank between the saves that recorded them). One never
        #: drawn from (an unseeded one each new process starts with) feeds nothing, whatever its state.
        self.in_use: dict[int, set[str]] = {}
        for (rank, step), signature in self.signatures.items():
            following = self.signatures.get((rank, step + 1))
            if following is None or any(
                    resume.get("rank") == rank and type(resume.get("resumed_ns")) is int
                    and signature.saved_ns < resume["resumed_ns"] < following.saved_ns for resume in self.resumes):
                continue
            for name, digest in signature.rng.items():
                if following.rng.get(name, digest) != digest:
                    self.in_use.setdefault(rank, set()).add(name)


    def _add_steps(self, rank: int, steps: dict, saved_ns: int, where: str) -> None:
        """A record's steps of ``rank`` (spec 9.4 ``steps``), each a computation of its step."""
        columns = decode_steps(steps, where)
        outputs = {name: _bits(columns, name) for name in OUTPUTS}
        for row, step in enumerate(columns.step.tolist()):
            kind = int(columns.batch_kind[row])
            self.branches.setdefault((rank, step), []).append(StepSignature(
                batch_kind=kind, batch=bytes(columns.batch[row]) if kind else None,
                rng={name: bytes(digests[row]) for name, digests in columns.rng.items() if digests[row].any()},
                outputs={name: value for name, bits in outputs.items() if (value := bits[row]) is not None},
                saved_ns=saved_ns, start_ns=int(columns.start_ns[row])))


def _bits(columns: Any, name: str) -> list[bytes | None]:
    values = columns.metrics.get(name)
    if values is None:
        return [None] * columns.count
    missing = columns.metrics_missing.get(name)
    return [None if missing is not None and missing[row] else values[row].tobytes() for row in range(columns.count)]


def certify(reference: str | os.PathLike, run: str | os.PathLike | None = None, *,
            storage_options: dict | None = None) -> Certificate | list[Certificate]:
    """Certify ``run`` against ``reference`` (see the module docstring); with ``reference`` alone,
    certify each of its resumes (a list, one certificate per resume)."""
    if run is None:
        return certify_resumes(reference, storage_options=storage_options)
    ref, new = RunRecords(reference, storage_options), RunRecords(run, storage_options)
    certificate = Certificate(ref.url, new.url, "undetermined", 0)
    common = sorted(set(ref.signatures) & set(new.signatures), key=lambda key: (key[1], key[0]))
    if not common:
        certificate.missing = _missing_steps(ref, new)
        return certificate
    steps = sorted({step for _, step in common})
    compared = 0
    for step in steps:
        ranks = sorted(rank for rank, s in common if s == step)
        found = _differences(ref.signatures, new.signatures, step, ranks, _in_use(ref, new))
        if found is None:  # a signature lacks what an answer needs (an output)
            certificate.missing = f"step {step}: no output of a rank (loss, gradient norm) is on record in " \
                                  "both runs (StepTimer.metrics(loss=...))"
            certificate.steps_compared = compared
            return certificate
        compared += 1
        if found:
            certificate.steps_compared = compared
            _diverged(certificate, ref, new, step, found)
            return certificate
    certificate.steps_compared = compared
    certificate.verdict = "identical"
    return certificate


def _missing_steps(ref: RunRecords, new: RunRecords) -> str:
    for records in (ref, new):
        if not records.signatures:
            return f"{records.url}: no training steps on record (a StepTimer handed to the saves)"
    return "the runs have no step in common on any rank"


def _in_use(*runs: RunRecords) -> dict[int, set[str]]:
    """Per rank, the generators either run drew from."""
    used: dict[int, set[str]] = {}
    for records in runs:
        for rank, names in records.in_use.items():
            used.setdefault(rank, set()).update(names)
    return used


def _differences(reference: dict[tuple[int, int], StepSignature], run: dict[tuple[int, int], StepSignature], step: int,
                 ranks: list[int], in_use: dict[int, set[str]] | None = None) -> dict[str, list[str]] | None:
    """What differs at ``step``, by kind (``data``, ``rng``, ``outputs``), with evidence; None where a
    rank's signatures share no output, so that equal inputs cannot be told to give equal outputs.
    ``in_use``: per rank, the generators compared (those drawn from); all where not given."""
    found: dict[str, list[str]] = {}
    for rank in ranks:
        a, b = reference[rank, step], run[rank, step]
        if a.batch_kind and b.batch_kind and (a.batch_kind, a.batch) != (b.batch_kind, b.batch):
            found.setdefault("data", []).append(f"rank {rank}: batch {_hex(a.batch)} vs {_hex(b.batch)}")
        compared = set(a.rng) & set(b.rng)
        for name in sorted(compared if in_use is None else compared & in_use.get(rank, set())):
            if a.rng[name] != b.rng[name]:
                found.setdefault("rng", []).append(f"rank {rank}: generator {name} {_hex(a.rng[name])} vs "
                                                   f"{_hex(b.rng[name])}")
        outputs = [name for name in OUTPUTS if name in a.outputs and name in b.outputs]
        if not outputs:
            return None
        for name in outputs:
            if a.outputs[name] != b.outputs[name]:
                found.setdefault("outputs", []).append(
                    f"rank {rank}: {name} {_float(a.outputs[name])} vs {_float(b.outputs[name])}")
    return found


def _diverged(certificate: Certificate, ref: RunRecords, new: RunRecords, step: int,
              found: dict[str, list[str]]) -> None:
    resumes = _resumes_before(new, step)
    repeated = _repeated_batches(ref, new, step)
    if repeated and "data" in found:
        found["data"] += repeated
    restored = _restored_generators(resumes[-1] if resumes else None)
    order = ("data", "rng") if restored or (restored is None and repeated) else ("rng", "data")
    causes = _resized(resumes) + [Cause(kind, found[kind]) for kind in order if kind in found]
    causes += _load_causes(resumes, found)
    causes += [cause for cause in _recorded_causes(ref, new, step) if cause.cause not in {c.cause for c in causes}]
    if "outputs" in found and not causes:
        causes.append(Cause("nondeterminism", ["batch and generators agree at the step's start",
                                               *found["outputs"]]))
    ranks = sorted({int(line.split(":")[0].split()[1]) for lines in found.values() for line in lines
                    if line.startswith("rank ")})
    certificate.verdict = "diverged"
    certificate.causes = causes
    evidence = causes[0].evidence + [line for line in found.get("outputs", [])[:1] if line not in causes[0].evidence]
    certificate.first_divergence = {"step": step, "ranks": ranks, "cause": causes[0].cause, "evidence": evidence}


def _resumes_before(records: RunRecords, step: int) -> list[dict]:
    """The run's resumes that came before its ``step``, oldest first: a resume comes before a step that a
    later save recorded on its rank (a step computed before a resume and never saved is lost with its
    process); where that rank has no such step on record, a resume from a checkpoint of an earlier step."""
    before = []
    for resume in records.resumes:
        rank = resume.get("rank")
        signature = records.signatures.get((rank, step)) if type(rank) is int else None
        resumed_ns, resumed_at = resume.get("resumed_ns"), (resume.get("from") or {}).get("step")
        if signature is not None and type(resumed_ns) is int:
            if resumed_ns < signature.saved_ns:
                before.append(resume)
        elif type(resumed_at) is int and resumed_at < step:
            before.append(resume)
    return sorted(before, key=lambda resume: resume.get("resumed_ns") or 0)


def _resized(resumes: list[dict]) -> list[Cause]:
    """A resume on another world size than the checkpoint's: it comes first, as every rank's batches,
    generators and shards change with it."""
    lines = []
    for resume in resumes:
        then, now = (list(resume.get("world_size") or []) + [None, None])[:2]
        if type(then) is int and type(now) is int and then != now:
            lines.append(f"rank {resume.get('rank')}: the resume from {(resume.get('from') or {}).get('name')} "
                         f"went from {then} to {now} ranks")
    return [Cause("topology", lines)] if lines else []


def _restored_generators(resume: dict | None) -> bool | None:
    """Whether a resume is on record as having restored the generators (None: not on record).

    Where batches and generators both differ, a generator that differs explains the batches (a loader
    shuffles from it) when the resume did not restore them; when it did, the data pipeline drew from
    them since (a loader restarted its epoch) and the batches are the cause; when the record does not
    say, batches the reference was fed before are the sign of a data position not restored."""
    verdicts = [part.get("verdict") for part in (resume or {}).get("parts") or [] if part.get("part") == "rng"]
    return None if not verdicts else verdicts[-1] == "equal"


def _repeated_batches(ref: RunRecords, new: RunRecords, step: int) -> list[str]:
    """The run's batches at ``step`` that the reference was fed at an earlier step on the same rank:
    samples repeated, the data position not restored (whatever the generators did)."""
    seen: dict[tuple[int, int, bytes], int] = {}
    for (rank, each), signature in ref.signatures.items():
        if each < step and signature.batch_kind and signature.batch is not None:
            key = (rank, signature.batch_kind, signature.batch)
            seen[key] = min(each, seen.get(key, each))
    lines = []
    for (rank, each), signature in sorted(new.signatures.items()):
        if each == step and signature.batch_kind and signature.batch is not None:
            earlier = seen.get((rank, signature.batch_kind, signature.batch))
            if earlier is not None:
                lines.append(f"rank {rank}: the reference's batch of step {earlier} again (position not restored)")
    return lines


#: A part that feeds a step an input (spec 9.4 ``feeds``) -> the kind of difference its fault shows as.
_SHOWN_AS = {"batches": "data", "generators": "rng"}


def _load_causes(resumes: list[dict], found: dict[str, list[str]]) -> list[Cause]:
    """The resumes (before the step) on record as not restoring a part. A part that feeds the step an
    input counts only where that input differs: where the batches agree, a data loader's position
    on record as different did not change this step (a loader that reports a position it does not
    hold)."""
    causes = []
    for resume in resumes:
        wrong = [part for part in resume.get("parts") or [] if part.get("verdict") in ("missing", "different")
                 and _may_explain(part, found)]
        if wrong:
            name = (resume.get("from") or {}).get("name")
            causes.append(Cause("load", [line for part in wrong for line in _part_lines(
                f"rank {resume.get('rank')}: the resume from {name} left", part)]))
    return causes


def _may_explain(part: dict, found: dict[str, list[str]]) -> bool:
    """Whether a part not restored may explain the differences ``found`` at a step: a part of the state
    may; one that feeds the step an input only where that input differs."""
    shown_as = _SHOWN_AS.get(str(part.get("feeds")))
    return shown_as is None or shown_as in found


def _recorded_causes(ref: RunRecords, new: RunRecords, step: int) -> list[Cause]:
    """What the runs' checkpoints record differently by ``step``: settings, topology, environment."""
    try:
        comparison = compare(ref.url, new.url, storage_options=ref.storage_options)
    except CheckpointError:  # no checkpoint to compare (all removed): the steps' evidence stands alone
        return []
    # A setting changed before the step is on record from the first checkpoint after the change: the
    # differences seen by the first common checkpoint at or after the step count, no later ones.
    seen_by = min((c.step for c in comparison.checkpoints if c.step >= step), default=step)
    by_cause: dict[str, list[str]] = {}
    for difference in comparison.differences:
        cause = _CAUSE_OF_KIND.get(difference.kind)
        if cause is None or difference.first_step > seen_by or difference.field in ("hostname", "hosts"):
            continue
        by_cause.setdefault(cause, []).append(f"{difference.field}: {difference.a!r} vs {difference.b!r} "
                                              f"(from step {difference.first_step})")
    order = ("hyperparameters", "topology", "environment")
    return [Cause(cause, by_cause[cause]) for cause in order if cause in by_cause]


def certify_resumes(run: str | os.PathLike, *, storage_options: dict | None = None) -> list[Certificate]:
    """Each resume of ``run``: its record of what it restored, and the steps computed again after it
    against the original branch's (``certify(run)``)."""
    records = RunRecords(run, storage_options)
    certificates = []
    for resume in records.resumes:
        source, rank = resume.get("from") or {}, resume.get("rank")
        resumed_at = source.get("step")
        certificate = Certificate(records.url, records.url, "undetermined", 0, resumed_from=source.get("name"),
                                  resume={key: value for key, value in resume.items() if key != "saved_ns"})
        if type(rank) is not int or type(resumed_at) is not int:
            certificate.missing = "the resume's record names no rank or step"
            certificates.append(certificate)
            continue
        load = [Cause("load", _part_lines(f"rank {rank}: the resume left", part))
                for part in resume.get("parts") or [] if part.get("verdict") in ("missing", "different")]
        again = sorted(step for (each, step), signatures in records.branches.items()
                       if each == rank and len(signatures) > 1 and step >= resumed_at)
        for step in again:
            before, after = records.branches[rank, step][-2:]
            found = _differences({(rank, step): before}, {(rank, step): after}, step, [rank], records.in_use)
            if found is None:
                break
            certificate.steps_compared += 1
            if found:
                order = ("data", "rng") if _restored_generators(resume) else ("rng", "data")
                causes = [Cause(kind, found[kind]) for kind in order if kind in found] + load
                causes = causes or [Cause("nondeterminism", found.get("outputs", []))]
                certificate.verdict, certificate.causes = "diverged", causes
                certificate.first_divergence = {"step": step, "ranks": [rank], "cause": causes[0].cause,
                                                "evidence": causes[0].evidence}
                break
        if certificate.verdict == "undetermined":
            if load:
                certificate.verdict, certificate.causes = "diverged", load
                certificate.first_divergence = {"step": resumed_at + 1, "ranks": [rank], "cause": "load",
                                                "evidence": load[0].evidence}
            elif certificate.steps_compared:
                certificate.verdict = "identical"
            else:  # a certificate that compared no step vouches for nothing that ran after the resume
                restored = sum(part.get("stored") or 0 for part in resume.get("parts") or [])
                certificate.missing = (
                    "no step was computed again after the resume to compare" +
                    (f" (its record says every part was restored: {restored} entries equal)" if restored else
                     ", and its record holds no parts") +
                    "; `ckptfmt certify REFERENCE RUN` compares the run's steps with another run's")
        certificates.append(certificate)
    return certificates


def resumes_verdict(resumes: list[Certificate]) -> str:
    """One sentence on a run's resumes (``certify(run)``'s certificates)."""
    verdicts = {certificate.verdict for certificate in resumes}
    restored = all(certificate.verdict == "identical" or _restored_every_part(certificate) for certificate in resumes)
    return ("No resume on record" if not resumes else
            "A resume diverged" if "diverged" in verdicts else
            "Every resume restored what its checkpoint held" if restored else "Some resumes cannot be certified")


def _restored_every_part(certificate: Certificate) -> bool:
    """Whether a resume's record says it restored every part (whether a step ran the same after it is
    another matter: its certificate may still be undetermined)."""
    parts = (certificate.resume or {}).get("parts") or []
    return bool(parts) and all(part.get("verdict") in ("equal", "not stored") for part in parts)


def _part_lines(what: str, part: dict) -> list[str]:
    """A part a resume did not restore: what, how many entries, then its first keys, one a line (a key
    is not split, and the lines stay short)."""
    count = part.get("missing") if part.get("verdict") == "missing" else part.get("different")
    keys = list(part.get("keys") or [])[:3]
    return [f"{what} {part.get('part')} {part.get('verdict')} ({count} of {part.get('stored')} entries)",
            *(f"  {key}" for key in keys)]


def _hex(digest: bytes | None) -> str:
    return "none" if digest is None else digest.hex()[:12]


def _float(bits: bytes) -> str:
    """An output's value as its bits hold it: float32's shortest form where it is one (most are)."""
    value = struct.unpack("<d", bits)[0]
    return str(np.float32(value)) if float(np.float32(value)) == value else repr(value)

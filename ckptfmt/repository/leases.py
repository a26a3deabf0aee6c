"""Leases: saves hold a save lease from before they look at the repository until they commit; the
garbage collector deletes only under a gc lease while no save lease is live (spec 11.6).

Each side writes its lease before reading the other's; leases expire (a heartbeat
keeps a running holder's in the future), and a holder whose own lease may have
lapsed stops before acting on it. Why this is enough, and what was rejected:
docs/design/leases-and-gc.md.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ckptfmt._platform import process_gone, process_identity
from ckptfmt.errors import CheckpointError, StorageError
from ckptfmt.format.features import check_object, version_fields
from ckptfmt.format.layout import LEASES_DIR
from ckptfmt.format.maps import unique_map
from ckptfmt.repository.repository import Repository

LEASE_FORMAT = "ckptfmt-lease"
SAVE, GC = "save", "gc"
#: A lease is valid this long after its holder last renewed it.
LEASE_TTL_S = 60.0
#: Leases are renewed this often (a quarter of their lifetime: three renewals may fail first).
RENEW_EVERY_S = LEASE_TTL_S / 4
#: How far apart writers' clocks may be; another process's lease counts as live this long past its expiry.
CLOCK_SKEW_S = 30.0
#: A holder stops trusting its own lease this long before it expires (by its own clock).
SAFETY_MARGIN_S = 10.0
MAX_LEASE_BYTES = 4096
#: This process as its leases name it (a forked child names itself again).
_PROCESS = process_identity()


def _name_the_child() -> None:
    global _PROCESS
    _PROCESS = process_identity()


os.register_at_fork(after_in_child=_name_the_child)


class LeaseLostError(StorageError):
    """This process's lease expired or could not be renewed: acting on it could break a checkpoint."""


@dataclass(frozen=True)
class LeaseRecord:
    """A lease as stored: who holds it, and until when (the holder's wall clock)."""

    key: str
    kind: str
    holder: str
    expires_ns: int
    #: The holding process as ``_platform.process_identity`` names it (format 1.15), or None.
    process: dict | None = None

    def expired(self, now_ns: int) -> bool:
        """Past its expiry plus the clock skew: its holder was killed or lost it (it is then reclaimed)."""
        return now_ns > self.expires_ns + int(CLOCK_SKEW_S * 1e9)

    def live(self, now_ns: int) -> bool:
        """Not expired, unless its holder is a process of this machine that has certainly ended: a killed
        save's lease then stalls no one (spec 11.6, 1.15). It stays until it expires, as the trace of a killed
        save that ``verify`` reads (``saves_running_or_killed``)."""
        return not self.expired(now_ns) and not process_gone(self.process)

    def describe(self, now_ns: int) -> str:
        """Who holds it and until when, for messages: '_leases/save-....json, held by host:4242 until 12:03:07
        UTC (in 41 s)'; the time is the holder's expiry plus the allowed clock skew, when others stop waiting."""
        until_ns = self.expires_ns + int(CLOCK_SKEW_S * 1e9)
        clock = time.strftime("%H:%M:%S UTC", time.gmtime(until_ns / 1e9))
        return f"{self.key}, held by {self.holder} until {clock} (in {max(0, round((until_ns - now_ns) / 1e9))} s)"


class Lease:
    """One lease object, renewed by a daemon thread until released."""

    def __init__(self, repo: Repository, kind: str, ttl_s: float = LEASE_TTL_S, max_hold_s: float | None = None):
        self.repo = repo
        self.kind = kind
        self.ttl_s = ttl_s
        #: Renewals stop after this long (a holder that may never be told to release: it then expires).
        self.max_hold_s = max_hold_s
        self.key = f"{LEASES_DIR}/{kind}-{secrets.token_hex(8)}.json"
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._valid_until_ns = 0
        self._renew_error: Exception | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> Lease:
        """Write the lease (durable) and start renewing it."""
        self._write()
        self._renewer = threading.Thread(target=self._renew_loop, name=f"ckptfmt-lease-{self.kind}", daemon=True)
        self._renewer.start()
        return self

    def release(self) -> None:
        """Stop renewing and delete the lease (best effort: an undeleted lease just expires)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        try:
            self.repo.storage.delete(self.key)
        except CheckpointError:
            pass

    def check(self, what: str) -> None:
        """Raise LeaseLostError unless the lease holds for at least the safety margin more."""
        remaining_s = (self._valid_until_ns - time.time_ns()) / 1e9
        if remaining_s < SAFETY_MARGIN_S:
            cause = f": renewing it failed ({self._renew_error})" if self._renew_error else ""
            raise LeaseLostError(f"{self.repo.storage.describe(self.key)}: this process's {self.kind} lease "
                                 f"has expired or is about to{cause}; stopping before {what}")

    def _write(self) -> None:
        now = time.time_ns()
        expires = now + int(self.ttl_s * 1e9)
        record = {"format": LEASE_FORMAT, **version_fields(self.repo.format_version), "kind": self.kind,
                  "holder": self.holder, "created_ns": now, "expires_ns": expires,
                  **({"process": _PROCESS} if _PROCESS is not None else {})}
        # Visible to other processes is enough: a crash that loses the lease ends its holder too.
        self.repo.storage.write(self.key, json.dumps(record).encode(), durable=False)
        self._valid_until_ns = expires

    def _renew_loop(self) -> None:
        give_up = None if self.max_hold_s is None else time.monotonic() + self.max_hold_s
        while not self._stop.wait(min(RENEW_EVERY_S, self.ttl_s / 4)):
            if give_up is not None and time.monotonic() > give_up:
                return
            if time.time_ns() > self._valid_until_ns:
                # Lapsed (the process was paused): others may have reclaimed it and acted meanwhile, so it is
                # never written again; check() refuses from now on.
                self._renew_error = LeaseLostError("it expired before it could be renewed")
                return
            try:
                self._write()
                self._renew_error = None
            except Exception as exc:  # keep trying; check() refuses to act once the lease runs out
                self._renew_error = exc


def read_leases(repo: Repository) -> tuple[list[LeaseRecord], list[str]]:
    """The repository's leases, and the keys of those that cannot be read as one (garbage, too big).

    An unreadable lease counts as live to whoever reads it (fail safe): it is reported, never ignored.
    """
    records, unreadable = [], []
    for entry in repo.storage.list(LEASES_DIR):
        key = f"{LEASES_DIR}/{entry}"
        if entry.startswith("."):  # a local temporary file of a lease being written
            continue
        try:
            records.append(_parse(repo.storage.read(key, max_size=MAX_LEASE_BYTES), key))
        except FileNotFoundError:  # released between the listing and the read
            continue
        except StorageError:
            raise
        except (CheckpointError, ValueError, KeyError, TypeError):
            unreadable.append(key)
    return records, unreadable


def _parse(data: bytes, key: str) -> LeaseRecord:
    doc = json.loads(data, object_pairs_hook=unique_map)
    if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT or doc.get("kind") not in (SAVE, GC):
        raise ValueError("not a ckptfmt lease")
    check_object(doc, key)  # a newer one is unreadable here: it counts as live (fail safe)
    expires = doc["expires_ns"]
    if type(expires) is not int:
        raise TypeError("expires_ns is not an integer")
    process = doc.get("process")
    return LeaseRecord(key=key, kind=doc["kind"], holder=str(doc.get("holder", "?")), expires_ns=expires,
                       process=process if isinstance(process, dict) else None)


def live_leases(repo: Repository, kind: str, *, reclaim_for: str | None = None) -> list[str]:
    """Descriptions of the live leases of ``kind``: key, holder, and until when it holds.

    Unreadable leases count as save leases: they stop the collector (which is
    what failing safe means for deletion) but never a save, since a collector
    only sweeps behind a lease it wrote whole. ``reclaim_for``: the caller's own
    lease key; the expired leases of others are deleted on the way (``reclaim``).
    """
    records, unreadable = read_leases(repo)
    now = time.time_ns()
    if reclaim_for is not None:
        reclaim(repo, [r.key for r in records if r.expired(now) and r.key != reclaim_for])
    live = [r.describe(now) for r in records if r.kind == kind and r.live(now)]
    return live + [f"{key} (unreadable: delete it if no save runs)" for key in unreadable] if kind == SAVE else live


def saves_running_or_killed(repo: Repository) -> bool:
    """Whether a save runs, or one was killed within its lease's lifetime: a save lease that has not
    expired, whether its holder runs or not (a holder that ends the normal way deletes its own); an
    unreadable lease counts. What a killed save left then is no damage to report."""
    records, unreadable = read_leases(repo)
    now = time.time_ns()
    return bool(unreadable) or any(record.kind == SAVE and not record.expired(now) for record in records)


def reclaim(repo: Repository, expired: list[str]) -> None:
    """Delete expired leases (past their expiry and the clock skew): their holders were killed or lost them,
    and a holder never renews a lapsed lease (``Lease``), so none comes back to life. Best effort: an
    expired lease left behind is ignored anyway. Unreadable leases are never reclaimed: they may be a live
    holder's, as far as anyone can tell. A lease of an ended holder of this machine, not live, is left
    until it expires: the trace of a killed save."""
    if not expired:
        return
    try:
        repo.storage.delete_many(expired)
    except CheckpointError:
        pass


@contextmanager
def save_lease(repo: Repository, *, timeout_s: float = 2 * (LEASE_TTL_S + CLOCK_SKEW_S),
               ttl_s: float = LEASE_TTL_S) -> Iterator[Lease]:
    """Hold a save lease for the block: taken before the save looks at the repository, released after
    its commit (or failure). Waits, up to ``timeout_s``, while a garbage collector is sweeping."""
    lease = hold_save_lease(repo, timeout_s=timeout_s, ttl_s=ttl_s)
    try:
        yield lease
    finally:
        lease.release()


def hold_save_lease(repo: Repository, *, timeout_s: float = 2 * (LEASE_TTL_S + CLOCK_SKEW_S),
                    ttl_s: float = LEASE_TTL_S, max_hold_s: float | None = None) -> Lease:
    """``save_lease`` for holders whose save spans several calls (a collective save's coordinator):
    the caller releases it.

    A save that finds a collector holding the repository withdraws its lease while
    it waits (the collector may be waiting for save leases to go), then tries again.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        lease = Lease(repo, SAVE, ttl_s, max_hold_s).acquire()
        sweeping = live_leases(repo, GC, reclaim_for=lease.key)
        if not sweeping:
            return lease
        lease.release()
        _wait_for_sweeps(repo, deadline)


def _wait_for_sweeps(repo: Repository, deadline: float) -> None:
    pause = 0.02
    while sweeping := live_leases(repo, GC):
        if time.monotonic() > deadline:
            raise StorageError(f"{repo.url}: a garbage collector has held the repository too long ({sweeping[0]}); "
                               "if none is running, delete that lease")
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def try_gc_lease(repo: Repository, drain_s: float = 0.0) -> tuple[Lease | None, list[str]]:
    """A gc lease once no save holds one: (lease, []), or (None, the live save leases).

    With ``drain_s``, the gc lease is held while running saves finish, up to that
    long: saves that start meanwhile wait for the sweep, so a busy repository
    still gets collected (at the cost of holding those saves up to ``drain_s``).
    """
    lease = Lease(repo, GC).acquire()
    deadline = time.monotonic() + drain_s
    pause = 0.01
    while saving := live_leases(repo, SAVE, reclaim_for=lease.key):
        if time.monotonic() >= deadline:
            lease.release()
            return None, saving
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
    return lease, []

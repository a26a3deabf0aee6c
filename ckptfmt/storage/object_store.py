"""Remote object stores (S3 and other fsspec backends): conditional writes checked, retries bounded.

What ckptfmt sets on an s3:// storage: botocore's timeouts and "standard"
retries (``S3_CONFIG_DEFAULTS``), two tries of s3fs's own retry loop
(``S3FS_TRIES``), a quick failure when the endpoint refuses connections
(``REFUSED_ATTEMPTS``), and retries of S3's 409 ConditionalRequestConflict.
Reads are tried again above all that (``READ_TRIES``, within ``READ_DEADLINE_S``):
a response cut short or failing botocore's checksum, which its retries do not
cover, and bytes that fail their own check (a chunk's hash, a manifest's, a
commit record's JSON) while a second read gives other bytes: damage in transit,
not in the store. The reasons are in docs/design/s3-retries.md.
"""

from __future__ import annotations

import builtins
import errno
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ckptfmt.errors import CheckpointError, CorruptDataError, ManifestError, StorageError
from ckptfmt.storage.base import Storage
from ckptfmt.storage.errors import backend_errors, translate_error

T = TypeVar("T")

#: The most keys one S3 DeleteObjects request takes.
_DELETE_BATCH = 1000
#: Tries of the keys a DeleteObjects request answered with an error that may pass.
_DELETE_TRIES = 4
#: Per-key DeleteObjects errors that may pass: S3 asks to slow down or failed inside.
_PASSING_DELETE_ERRORS = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"})
#: Tries of a conditional create that S3 answers with 409 ConditionalRequestConflict.
_CONFLICT_TRIES = 5
#: The backoff's jitter, apart from the global generator: a save must not move the training's RNG.
_JITTER = random.Random()


def _conditional_conflict(exc: Exception) -> bool:
    """Whether ``exc`` is S3's 409 ConditionalRequestConflict (s3fs chains botocore's error as the cause)."""
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") == "ConditionalRequestConflict"


class ObjectStorage(Storage):
    """Remote stores (S3 and other fsspec backends), whose conditional create cannot be taken on trust:
    a commit record is read back after its create, and again ``create_settle_s`` later
    (``Repository.create_commit``, spec 11.3; why: docs/design/s3-retries.md)."""

    #: Seconds between the two read-backs of a commit record.
    create_settle_s: float | None = 0.25

    def __init__(self, fs, root: str, url: str, *, read_tries: int = 0, read_deadline_s: float = 0.0):
        super().__init__(fs, root, url)
        if read_tries and (isinstance(read_tries, bool) or not isinstance(read_tries, int) or read_tries < 1):
            raise ValueError(f"read_tries must be a positive integer, not {read_tries!r}")
        #: Tries of a read, and the most time they may take (0: ``READ_TRIES``, ``READ_DEADLINE_S``).
        self.read_tries = read_tries or READ_TRIES
        self.read_deadline_s = float(read_deadline_s or READ_DEADLINE_S)

    def child(self, key: str) -> ObjectStorage:
        return ObjectStorage(self.fs, self.path(key), self.describe(key), read_tries=self.read_tries,
                             read_deadline_s=self.read_deadline_s)

    # -- reads, tried again ----------------------------------------------------
    def read(self, key: str, *, max_size: int) -> bytes:
        return self._retried(key, lambda: super(ObjectStorage, self).read(key, max_size=max_size))

    def size(self, key: str) -> int | None:
        return self._retried(key, lambda: super(ObjectStorage, self).size(key))

    def exists(self, key: str) -> bool:
        return self._retried(key, lambda: super(ObjectStorage, self).exists(key))

    def list(self, key: str = "") -> builtins.list[str]:
        return self._retried(key, lambda: super(ObjectStorage, self).list(key))

    def find(self, key: str) -> dict[str, int]:
        return self._retried(key, lambda: super(ObjectStorage, self).find(key))

    def read_checked(self, key: str, *, max_size: int, check: Callable[[bytes], T]) -> T:
        """``check`` of the bytes of ``key``, read again while they fail it with other bytes each time:
        bytes damaged in transit differ from read to read, bytes damaged in the store do not (the same
        bytes twice are the store's, and their error stands)."""
        previous = None
        for attempt in range(1, self.read_tries + 1):
            data = self.read(key, max_size=max_size)
            try:
                return check(data)
            except (CorruptDataError, ManifestError) as exc:
                if data == previous:
                    raise
                if attempt == self.read_tries:
                    raise type(exc)(f"{exc} (read {attempt} times, different bytes each time: the connection "
                                    "damages data)") from exc
                previous = data
        raise AssertionError("unreachable")  # pragma: no cover

    def _retried(self, key: str, operation: Callable[[], T]) -> T:
        """``operation``, tried again on a failure that may pass (a cut or damaged response, a 5xx that
        outlasted the client's retries), up to ``read_tries`` times within ``read_deadline_s``; the error
        that stays says how many tries it made."""
        started = time.monotonic()
        for attempt in range(1, self.read_tries + 1):
            try:
                return operation()
            except StorageError as exc:
                pause = 0.1 * 2 ** (attempt - 1) * (1 + _JITTER.random())
                spent = time.monotonic() - started
                if not _may_pass(exc) or attempt == self.read_tries or spent + pause > self.read_deadline_s:
                    if attempt == 1:
                        raise
                    raise StorageError(f"{exc} (after {attempt} tries over {spent:.1f} s)", exc.errno) from exc
                time.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    def create(self, key: str, data: bytes) -> None:
        # S3's 409 ConditionalRequestConflict is retried here (docs/design/s3-retries.md); the
        # retry gets 412 (the other write won: FileExistsError) or succeeds.
        with backend_errors(self.describe(key), passing=(FileExistsError,)):
            for attempt in range(_CONFLICT_TRIES):
                try:
                    self.fs.pipe_file(self.path(key), bytes(data), mode="create")
                    return
                except Exception as exc:
                    if attempt + 1 == _CONFLICT_TRIES or not _conditional_conflict(exc):
                        raise
                time.sleep(0.05 * 2**attempt * (1 + _JITTER.random()))

    def delete_many(self, keys: builtins.list[str]) -> None:
        call_s3 = getattr(self.fs, "call_s3", None)
        if call_s3 is None:  # not s3fs: one literal delete per key (Storage.delete_many)
            super().delete_many(keys)
            return
        # DeleteObjects on the exact keys, not s3fs's rm (it expands glob characters: a root runs[12] would
        # delete runs1/k) nor its _bulk_delete (it drops the per-key Errors: a refused key would stay unseen).
        for start in range(0, len(keys), _DELETE_BATCH):
            pending = keys[start : start + _DELETE_BATCH]
            for attempt in range(_DELETE_TRIES):
                passing = self._delete_objects(call_s3, pending)
                if not passing:
                    break
                if attempt == _DELETE_TRIES - 1:
                    key, failure = passing[0]
                    raise translate_error(failure, f"{self.describe(key)} (tried {_DELETE_TRIES} times)") from failure
                pending = [key for key, _ in passing]
                time.sleep(0.05 * 2**attempt * (1 + _JITTER.random()))

    def _delete_objects(self, call_s3, keys: builtins.list[str]) -> builtins.list[tuple[str, OSError]]:
        """One DeleteObjects request for ``keys``: raises the first refusal; returns the keys S3 answered
        with an error that may pass (SlowDown, InternalError), to be tried again."""
        bucket = self.fs.split_path(self.root)[0]
        batch = {self.fs.split_path(self.path(key))[1]: key for key in keys}
        try:
            with backend_errors(self.describe(keys[0])):
                out = call_s3("delete_objects", Bucket=bucket,
                              Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
        finally:
            for key in batch.values():
                self.fs.invalidate_cache(self.path(key))
        passing = []
        for error in out.get("Errors") or []:
            failure = _delete_failure(error)
            if isinstance(failure, FileNotFoundError):  # an absent key is no error
                continue
            refused = str(error.get("Key"))
            named = batch.get(refused)
            if named is not None and error.get("Code") in _PASSING_DELETE_ERRORS:
                passing.append((named, failure))
                continue
            raise translate_error(failure, self.describe(named) if named else f"s3://{bucket}/{refused}") from failure
        return passing

    def missing_container(self) -> str | None:
        bucket = self.fs._strip_protocol(self.root).split("/", 1)[0]
        with backend_errors(self.url):
            if bucket and not self.fs.exists(bucket):
                return f"the bucket {bucket!r} does not exist (or these credentials cannot see it)"
        return None


def _delete_failure(error: dict[str, Any]) -> OSError:
    """The exception s3fs raises for a single delete, for one entry of a DeleteObjects response's Errors
    (AccessDenied: a PermissionError, whose StorageError has errno EACCES)."""
    from s3fs.errors import ERROR_CODE_TO_EXCEPTION  # only s3fs storages get here: the S3 stack is loaded

    code = str(error.get("Code") or "unknown")
    message = f"{error.get('Message') or code} ({code})"
    constructor = ERROR_CODE_TO_EXCEPTION.get(code)
    return constructor(message) if constructor else OSError(errno.EIO, message)


#: Tries of a read (a request, or a read whose bytes fail their check) before its error stands.
READ_TRIES = 5
#: The most time a read spends on its tries; the next one is not started past it.
READ_DEADLINE_S = 120.0


def _may_pass(exc: CheckpointError) -> bool:
    """Whether a storage failure may pass if tried again: not a refusal (permissions, credentials), not
    a refused connection (nothing listens: ``fail_fast_when_refused``)."""
    if getattr(exc, "errno", None) in (errno.EACCES, errno.EPERM):
        return False
    cause = exc.__cause__
    return not isinstance(cause, PermissionError) and not _refused(cause)


#: botocore client settings for s3:// storages; each key of the caller's
#: ``storage_options["config_kwargs"]`` replaces the one here.
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 30,
    "retries": {"mode": "standard", "total_max_attempts": 6},
}
#: The AWS environment variables that take precedence over the ``retries`` default, key by key.
_RETRIES_ENVIRONMENT = {"mode": "AWS_RETRY_MODE", "total_max_attempts": "AWS_MAX_ATTEMPTS"}
#: Tries of s3fs's own retry loop (its default is 5; a class attribute, not an option: storage/s3.py).
S3FS_TRIES = 2


def s3_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over ckptfmt's S3 client defaults: botocore's "standard" retries, 6 attempts,
    10 s to connect and 30 s without a byte of the response (the reasons and the worst case:
    docs/design/s3-retries.md). ``AWS_RETRY_MODE`` and ``AWS_MAX_ATTEMPTS`` in the environment
    keep precedence (botocore reads them for the keys missing from ``retries``).
    """
    retries = {key: value for key, value in S3_CONFIG_DEFAULTS["retries"].items()
               if _RETRIES_ENVIRONMENT[key] not in os.environ}
    defaults = {**S3_CONFIG_DEFAULTS, "retries": retries}
    return {**options, "config_kwargs": {**defaults, **(options.get("config_kwargs") or {})}}


#: Attempts at a request whose connection the endpoint refuses (nothing listens there).
REFUSED_ATTEMPTS = 2


def fail_fast_when_refused(fs) -> None:
    """Stop botocore's retries once an endpoint has refused the connection twice (nothing listens
    there: it will not heal within a backoff; docs/design/s3-retries.md). Timeouts, resets and 5xx
    answers keep every retry. Registered once per client (s3fs caches filesystems).
    """
    client = fs.connect() if getattr(fs, "_s3", None) is None else fs.s3
    if getattr(client, "_ckptfmt_fail_fast", False):
        return
    client.meta.events.register_first("needs-retry.s3", _raise_when_refused)
    client._ckptfmt_fail_fast = True


def _raise_when_refused(attempts: int, caught_exception: Exception | None = None, **_: Any) -> None:
    if caught_exception is not None and attempts >= REFUSED_ATTEMPTS and _refused(caught_exception):
        raise caught_exception


def _refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` (botocore's error, aiohttp's inside it) comes from a refused connection."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError):
            return True
        inner = getattr(exc, "kwargs", {}).get("error") if isinstance(getattr(exc, "kwargs", None), dict) else None
        exc = inner or getattr(exc, "os_error", None) or exc.__cause__ or exc.__context__
    return False

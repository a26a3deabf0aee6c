"""The storage boundary: what a backend raises becomes a ckptfmt error naming the key, cause kept.

Every call into fsspec, the OS or an object store's client runs inside
``backend_errors(what)``: a ``CheckpointError`` passes through (and, where a
caller says so, ``FileExistsError``: the write-once ``create``'s answer),
anything else is translated by ``translate_error`` and raised ``from`` the
backend's exception, so ``--debug`` shows the botocore, aiohttp or errno failure
underneath the one-line message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from errno import EACCES

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, StorageError


def translate_error(exc: BaseException, what: str) -> CheckpointError:
    """The ckptfmt error for a backend's exception about ``what`` (a key's URL)."""
    if isinstance(exc, CheckpointError):
        return exc
    errno = exc.errno if isinstance(exc, OSError) else None
    if isinstance(exc, FileNotFoundError):
        error: CheckpointError = CheckpointNotFoundError(f"{what}: not found")
    elif isinstance(exc, NotADirectoryError):  # a folder on the way is a file: nothing can be at this key
        error = CheckpointNotFoundError(f"{what}: not found (a folder on its path is a file)")
    elif isinstance(exc, PermissionError):
        error = StorageError(f"{what}: permission denied", EACCES if errno is None else errno)  # S3's 403s have none
    elif isinstance(exc, OSError) and exc.strerror:  # "Not a directory", not "NotADirectoryError: [Errno 20] ..."
        error = StorageError(f"{what}: {exc.strerror}", errno)
    else:
        error = StorageError(f"{what}: {exc}", errno)
    if isinstance(error, CheckpointNotFoundError):
        error.errno = errno
    return error


@contextlib.contextmanager
def backend_errors(what: str, *, passing: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run backend calls about ``what``; their failures leave as ckptfmt errors, chained to the cause.

    ``passing``: exception types that leave untranslated (``create``'s FileExistsError).
    """
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        if isinstance(exc, passing):
            raise
        raise translate_error(exc, what) from exc

"""The exception hierarchy: every bad input, missing or corrupt datum raises a CheckpointError.

Subclasses also derive from the builtin they resemble (as zarr does), so that
``except FileNotFoundError`` or ``except ValueError`` in a caller keeps working.
"""

from __future__ import annotations

import os
import reprlib
import sys
import types
import warnings


class CheckpointError(Exception):
    """Root of every error ckptfmt raises for bad input, missing or corrupt data."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A repository, checkpoint or chunk that should exist does not."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint with that name is already committed; checkpoints are immutable."""


class CorruptDataError(CheckpointError, ValueError):
    """Stored bytes do not match their hash, size or encoding."""


class ManifestError(CheckpointError, ValueError):
    """A manifest or commit record is malformed, inconsistent or over a limit."""


class StateMismatchError(CheckpointError, ValueError):
    """The state a load fills (``load(into=...)``) does not match the checkpoint: entries one has and the
    other lacks, or tensors of another shape or dtype, each named. The checkpoint itself is sound."""


class UnsupportedVersionError(CheckpointError):
    """The data was written by a newer, incompatible major version of the format."""


class InvalidNameError(CheckpointError, ValueError):
    """A checkpoint name, key or hash breaks the naming rules (e.g. path traversal)."""


class UnsafePathError(CheckpointError, PermissionError):
    """An operation that deletes or overwrites would act through a symbolic link or outside its repository's
    folder (another repository's checkpoint, a user's files): refused, naming the link."""


class UnsupportedValueError(CheckpointError, TypeError):
    """save() was given a value the format cannot represent exactly."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed (permissions, network, credentials).

    ``errno`` is the operating system's error number where the failure had one
    (``errno.EACCES``, ``errno.ENOSPC``, ...), else None; ``__cause__`` is the
    backend's own exception (OSError, botocore's, aiohttp's), shown by ``--debug``.
    """

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):  # keeps errno across pickling (the replication child sends errors back)
        return type(self), (self.args[0], self.errno)


class CollectiveError(CheckpointError):
    """A collective save or load could not finish on every rank (a rank failed, died or never
    called it); nothing was committed."""


class CheckpointWarning(UserWarning):
    """Something worth knowing that did not stop the operation (a damaged checkpoint skipped when listing).

    Filter it like any warning: ``warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)``.
    """


def warn_caller(message: str) -> None:
    """Warn (``CheckpointWarning``) at the innermost frame outside ckptfmt: the user's line that called it,
    however deep inside ckptfmt the warning arose (a fixed ``stacklevel`` names a ckptfmt line whenever the
    call path changes)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: types.FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: this function's caller
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, CheckpointWarning, stacklevel=level)


_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother = 3, 80, 80


def quoted(value: object) -> str:
    """``repr(value)`` for an error message, bounded in depth and length: a value read from a damaged or
    hostile file may be nested thousands deep (plain ``repr`` would recurse out) or megabytes long."""
    return _QUOTE.repr(value)

"""The storage for a URL: a local path, ``file://``, ``memory://``, ``s3://`` or any fsspec URL."""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ckptfmt.errors import InvalidNameError, StorageError, quoted
from ckptfmt.storage.base import Storage
from ckptfmt.storage.errors import backend_errors
from ckptfmt.storage.local import LocalStorage
from ckptfmt.storage.object_store import ObjectStorage, fail_fast_when_refused, s3_options


def open_storage(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage for a local path or fsspec URL (``s3://``, ``memory://``, ``file://``).

    S3 endpoint and credentials come from ``storage_options`` or, as in a user's
    shell, from the standard AWS environment variables (``AWS_ENDPOINT_URL``, ...).
    s3:// storages get bounded timeouts and retries by default (``s3_options``);
    ``storage_options["read_tries"]`` and ``["read_deadline_s"]`` (ckptfmt's own,
    not passed to fsspec) bound how often and how long a remote read is tried.
    """
    url = check_no_parent_segments(os.fspath(url))
    options = dict(storage_options or {})
    read_bounds = {key: options.pop(key) for key in ("read_tries", "read_deadline_s") if key in options}
    s3 = fsspec.core.split_protocol(url)[0] in ("s3", "s3a")
    with backend_errors(url):
        try:
            fs, root = _s3_filesystem(url, options) if s3 else fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            raise StorageError(f"{url}: missing backend ({exc}); for s3:// install ckptfmt[s3]") from exc
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(fs, root, url)
    if isinstance(fs, MemoryFileSystem):
        return Storage(fs, root, url)
    if s3:
        fail_fast_when_refused(fs)
    return ObjectStorage(fs, root, url, **read_bounds)


def _s3_filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """ckptfmt's S3 filesystem for ``url`` (its retries bounded on its own class: a user's s3fs
    filesystem of the same options is another object, left as it is) and the path within it.

    fsspec reads the URL and the options first, as for any URL (options keyed by protocol, such as
    ``{"s3": {...}}``, merged in; ``open()``'s own keys left out), on an s3fs object kept out of its cache.
    """
    from ckptfmt.storage.s3 import BoundedS3FileSystem

    options = s3_options(options)
    cached = not options.pop("skip_instance_cache", False)
    read, root = fsspec.core.url_to_fs(url, **options, skip_instance_cache=True)
    return BoundedS3FileSystem(**read.storage_options, skip_instance_cache=not cached), root


def check_no_parent_segments(url: str) -> str:
    """``url``, refused if a ``..`` segment follows another segment (``repo/../escape``).

    Resolved away, it would make another folder the repository than the one the
    user named (``save(state, "repo/../escape")`` made the parent folder one), and
    on object stores ``..`` is a literal key. Leading ``..`` in a local relative path
    (``../runs/exp1``) names a folder plainly and is kept.
    """
    protocol, _, path = url.rpartition("://")
    segments = path.split("/")
    leading = 0
    if not protocol or protocol == "file":
        while leading < len(segments) and segments[leading] in ("..", "."):
            leading += 1
    if ".." in segments[leading:]:
        raise InvalidNameError(f"{quoted(url)}: a '..' segment inside a checkpoint or repository URL is refused: "
                               "it would be resolved away and make another folder the repository; give the path "
                               "without it")
    return url


def in_process_memory(url: str | os.PathLike) -> bool:
    """Whether ``url`` names storage that lives in this process's memory (memory://), out of another's reach."""
    return fsspec.core.split_protocol(os.fspath(url))[0] == "memory"

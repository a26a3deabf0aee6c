"""ckptfmt's own S3 filesystem class: s3fs with its retry loop bounded, imported only for s3:// URLs.

s3fs's retry count is a class attribute, not an option, and fsspec caches filesystem instances per
class: setting it on an instance changed the filesystem any other code in the process got for the same
options. A subclass holds ckptfmt's bound, and fsspec caches its instances apart from s3fs's own.
"""

from __future__ import annotations

from s3fs import S3FileSystem

from ckptfmt.storage.object_store import S3FS_TRIES


class BoundedS3FileSystem(S3FileSystem):
    """s3fs's S3FileSystem with ``S3FS_TRIES`` tries of its own retry loop (its default is 5, each
    multiplied by botocore's attempts: docs/design/s3-retries.md)."""

    retries = S3FS_TRIES

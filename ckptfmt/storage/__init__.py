"""Where bytes live: one small interface (Storage) over fsspec, with a local-disk implementation
(fsync, renames, zero-copy reads) and one for object stores such as S3 (conditional writes, bounded
retries).
"""

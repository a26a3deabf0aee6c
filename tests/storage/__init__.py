"""Storage backends and repositories: local disk, memory://, S3 (moto) with faults, the commit index."""

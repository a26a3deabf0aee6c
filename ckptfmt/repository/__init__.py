"""A repository of checkpoints on one storage: opening and creating it, commit records and the commit
index that lists them at S3 scale, and the leases that keep saves and garbage collection apart (spec
sections 4, 11).
"""

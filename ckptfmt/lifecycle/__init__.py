"""A run's checkpoints over time: CheckpointManager (when to save, where, restore), retention rules,
safe garbage collection, replication to slower tiers in a background child process, and checkpoint-
interval advice.
"""

"""CheckpointManager, retention, gc, replication, interval advice."""

"""The corpus of the past: checkpoints of every format version, written by the commits that introduced them."""

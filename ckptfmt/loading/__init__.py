"""The load path: opening a checkpoint (CheckpointReader, load, open), reading and verifying its
chunks, mapping them into memory, and filling an existing state in place, resharded where the saved
and wanted layouts differ.
"""

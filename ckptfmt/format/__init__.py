"""The format itself, as spec/FORMAT.md defines it (sections 4-10): names and layout of keys, limits,
dtypes, codecs, chunk hashing, the value tree, the manifest, the commit record, tiling, and the
tensor-like leaves a state may hold.
"""

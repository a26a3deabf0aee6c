"""The torch side of the line: what turns torch objects into the format's bytes and back.

``ckptfmt/format/`` is the spec and knows only bytes (and numpy views of them); this package holds the
adapters that need torch: the torch dtype of each format dtype name (``dtypes.py``), tensors as
sources of bytes and tensors rebuilt from them (``sources.py``), DTensors (``dtensors.py``), sharded
tensors a state may hold (``sharded.py``), and statistics taken from tensors (``stats.py``). The
storage, the repository, the byte-level lifecycle, ``tools/`` and the CLI never import it, so
inspecting a checkpoint never loads torch.
"""

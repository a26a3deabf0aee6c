"""``ckptfmt.dcp``: ckptfmt as a storage layer of torch.distributed.checkpoint (the public path).

    import torch.distributed.checkpoint as dcp
    dcp.save(state, storage_writer=ckptfmt.dcp.StorageWriter("runs/exp1/step-100"))
    dcp.load(state, storage_reader=ckptfmt.dcp.StorageReader("runs/exp1/step-100"))

The implementation lives in ckptfmt/distributed/dcp.py; ``import ckptfmt`` loads
this module on first use of ``ckptfmt.dcp``, so torch.distributed.checkpoint is
imported only by those who use it.
"""

from ckptfmt.distributed.dcp import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter"]

"""Saving and loading under torch.distributed: the collective save's protocol, process groups,
merging the ranks' value trees, and ckptfmt as a storage layer of torch.distributed.checkpoint (DCP).
"""

"""torch.distributed: collective saves, faults, the DCP layer, FSDP2, clean exits under torchrun."""

"""Bytes in and out: serialization without pickle, host staging buffers, copies into live
tensors, checksums and verified reads. Never touches torch.distributed."""

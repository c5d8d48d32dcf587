"""Triton kernels, each beside a torch reference of the same signature (none yet: FM-Delta decodes on CPU)."""

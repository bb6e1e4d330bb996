"""Attention kernels for edited layers: the blocked torch path and the fused `flex_attention` path."""

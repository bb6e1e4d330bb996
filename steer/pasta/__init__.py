"""PASTA (Zhang et al., ICLR 2024): the intervention and its head profiling."""

from steer.pasta.method import Pasta, PastaBias, pasta_column_bias
from steer.pasta.profiling import profile_heads, select_heads, smallest_k, target_ids

__all__ = [
    "Pasta",
    "PastaBias",
    "pasta_column_bias",
    "profile_heads",
    "select_heads",
    "smallest_k",
    "target_ids",
]

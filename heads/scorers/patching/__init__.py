"""Causal analysis of heads: prompt pairs, metrics, activation patching, path patching, direct
logit attribution and lenses (docs/methods/patching.md)."""

from heads.scorers.patching.activation import PatchResult, patch
from heads.scorers.patching.evaluate import evaluate_pairs
from heads.scorers.patching.logit import (
    DLAResult,
    LensResult,
    direct_logit_attribution,
    head_logits,
    logit_inspection,
    logit_lens,
)
from heads.scorers.patching.metrics import Metric, get_metric, normalise
from heads.scorers.patching.pairs import PairBatch, PromptPair, encode_pairs, load_pairs, pairs_from_tokens
from heads.scorers.patching.path import path_patch
from heads.scorers.patching.synthetic_images import colour_pairs, minimal_image_pair
from heads.scorers.patching.vision import ImagePair, ImagePairBatch, encode_image_pairs

__all__ = [
    "DLAResult",
    "ImagePair",
    "ImagePairBatch",
    "LensResult",
    "colour_pairs",
    "direct_logit_attribution",
    "encode_image_pairs",
    "head_logits",
    "logit_inspection",
    "logit_lens",
    "minimal_image_pair",
    "Metric",
    "PairBatch",
    "PatchResult",
    "PromptPair",
    "encode_pairs",
    "evaluate_pairs",
    "get_metric",
    "load_pairs",
    "normalise",
    "pairs_from_tokens",
    "patch",
    "path_patch",
]

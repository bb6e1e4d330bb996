"""Head roles: detectors (previous-token, duplicate-token, induction, self, entropy, copying,
successor, retrieval), the Attention Lens, and the head atlas gathering every per-head score."""

from heads.scorers.roles.atlas import ROLE_THRESHOLDS, HeadAtlas, head_atlas
from heads.scorers.roles.detectors import (
    ORDINAL_SEQUENCES,
    PATTERN_DETECTORS,
    copying_scores,
    detect_roles,
    duplicate_token_scores,
    entropy_scores,
    induction_scores,
    needle_prompts,
    pattern_scores,
    previous_token_scores,
    random_tokens,
    repeated_tokens,
    retrieval_scores,
    self_scores,
    successor_scores,
)
from heads.scorers.roles.lens import MAX_FULL_HEADS, AttentionLens, LensData, collect_lens_data, train_lens

__all__ = [
    "MAX_FULL_HEADS",
    "ORDINAL_SEQUENCES",
    "PATTERN_DETECTORS",
    "ROLE_THRESHOLDS",
    "AttentionLens",
    "HeadAtlas",
    "LensData",
    "collect_lens_data",
    "copying_scores",
    "detect_roles",
    "duplicate_token_scores",
    "entropy_scores",
    "head_atlas",
    "induction_scores",
    "needle_prompts",
    "pattern_scores",
    "previous_token_scores",
    "random_tokens",
    "repeated_tokens",
    "retrieval_scores",
    "self_scores",
    "successor_scores",
    "train_lens",
]

"""The explorer's bounds and cache sizes (every request is checked against them before any work)."""

__all__ = [
    "CARD_CACHE",
    "MAX_ANSWER_CHARS",
    "MAX_BODY_BYTES",
    "MAX_HEADS",
    "MAX_NEW_TOKENS",
    "MAX_PATTERN_TOKENS",
    "MAX_PROMPT_CHARS",
    "MAX_SOURCES_BYTES",
    "PATTERN_CACHE_BYTES",
    "SCORES",
    "SCORE_CACHE_PROMPTS",
]

MAX_BODY_BYTES = 32_768
"""Largest request body accepted (bytes)."""
MAX_PROMPT_CHARS = 4_000
"""Longest prompt accepted (characters)."""
MAX_NEW_TOKENS = 256
"""Largest `max_new_tokens` accepted."""
MAX_HEADS = 512
"""Most (layer, head) pairs in one steering request."""
MAX_ANSWER_CHARS = 64
"""Longest answer / counterfactual string of a patching pair (characters)."""
PATTERN_CACHE_BYTES = 512 * 2**20
"""Default byte budget of the per-tab pattern cache (`viz.explorer.patterns.PatternCache`)."""
SCORES = ("span", "sinks", "atlas", "dla", "ships", "maps", "probes")
"""Score choices of the overview grid."""
SCORE_CACHE_PROMPTS = 16
"""Prompts whose prompt-dependent grids (`"dla"`, `"ships"`) are kept, least recent out."""
CARD_CACHE = 256
"""Head cards (per prompt and head) kept, least recent out."""
MAX_PATTERN_TOKENS = 2048
"""Longest prompt (tokens) the explorer takes: its `[T, T]` pattern is sent to the page."""
MAX_SOURCES_BYTES = 512 * 2**20
"""Largest vocabulary source matrix `[V, D]` fp32 the head card keeps for MAPS (bytes)."""

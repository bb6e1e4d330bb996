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
    "MAX_WINDOW",
    "OVERVIEW_CACHE_BYTES",
    "OVERVIEW_GRID",
    "OVERVIEW_RESIDUAL_BYTES",
    "PATTERN_CACHE_BYTES",
    "SCORES",
    "SCORE_CACHE_PROMPTS",
]

MAX_BODY_BYTES = 2 * 2**20
"""Largest request body accepted (bytes): room for a prompt of `MAX_PROMPT_CHARS`."""
MAX_PROMPT_CHARS = 262_144
"""Longest prompt accepted (characters); its tokens are then checked against the model's
positions (`HeadModel.max_positions`), the explorer's real limit."""
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
MAX_PATTERN_TOKENS = 512
"""Longest prompt (tokens) whose whole `[T, T]` pattern is sent to the page; a longer one's
pattern view is an overview (`viz.explorer.overview`) and exact windows of at most
`MAX_WINDOW` x `MAX_WINDOW` cells."""
OVERVIEW_GRID = 256
"""Most blocks per side of an overview's pooled pattern (`[G, G]`, `G <= OVERVIEW_GRID`)."""
MAX_WINDOW = 256
"""Most query rows and most key columns of one pattern window (`/api/pattern` with `q0..k1`)."""
OVERVIEW_CACHE_BYTES = 1536 * 2**20
"""Default byte budget of the per-tab overview cache (overviews, and the residuals, keys and
values windows start from; one 8k-token prompt of SmolLM2-135M in fp32 takes about 1.1 GB)."""
OVERVIEW_RESIDUAL_BYTES = 768 * 2**20
"""Most bytes of residual stream one overview keeps for its windows (every layer's when they
fit, else every k-th layer's: a window then runs from the nearest kept layer below)."""
MAX_SOURCES_BYTES = 512 * 2**20
"""Largest vocabulary source matrix `[V, D]` fp32 the head card keeps for MAPS (bytes)."""

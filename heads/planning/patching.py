"""What activation patching (`heads.patch`) keeps beside its forwards, and which path it takes,
from the model's geometry alone: shared by the sweep (`heads.scorers.patching.lean.choose_lean`)
and its memory plan (`plan_memory(config, PatchRequest(...))`), so both agree by construction.

Two paths (heads/scorers/patching/lean.py):

* the fast path keeps both runs' full caches, `2 * full_cache_bytes` (per token and layer the
  residual, head outputs, attention and MLP outputs, KV cache and q / k / v projections; with
  `q` the queries, with `pattern` the fp32 patterns): about 190 residual-stream copies per run on
  SmolLM2, where a plain forward peaks near 11;
* the lean path keeps the patched sites of both runs and the base run's residual entering each
  patched layer > 0 (`lean_kept_bytes`).

`lean_default` decides: the fast path while its caches are at most `LEAN_MIN_BYTES`; the lean
path where they exceed `LEAN_ALWAYS_BYTES` (long prompts: SmolLM2 from about 610 tokens on,
every site and position spec), and in between where its work is at most `LEAN_TIME` times the
fast path's (token-layers).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BY_POSITION",
    "LEAN_ALWAYS_BYTES",
    "LEAN_MIN_BYTES",
    "LEAN_ROW_TOKENS",
    "LEAN_TIME",
    "PATCH_KINDS",
    "PATTERN_BLOCK_COPIES",
    "PATTERN_BLOCK_RESIDUALS",
    "full_cache_bytes",
    "lean_default",
    "lean_kept_bytes",
    "lean_rows",
    "patch_kept",
    "patch_work",
]

PATCH_KINDS = ("resid_pre", "attn_out", "mlp_out", "head_out", "head_out_by_pos", "q", "k", "v", "pattern")
"""The activation-patching site kinds (`heads.scorers.patching.request.KINDS`)."""
BY_POSITION = ("resid_pre", "attn_out", "mlp_out", "head_out_by_pos")
"""The kinds patched per position (`heads.scorers.patching.request.BY_POSITION`)."""

LEAN_MIN_BYTES = 256 * 2**20
"""Full caches (both runs) at most this size keep the fast path whatever its work ratio: the lean
path unembeds the whole vocabulary at the last position (the column-only unembedding reads the
final hidden state, which a forward keeping no hidden states does not return), a few percent of
a short prompt's forward (a sweep of every head on 8 IOI pairs on SmolLM2: 5% more CPU time)."""

LEAN_ALWAYS_BYTES = 512 * 2**20
"""Full caches above this size take the lean path whatever its work ratio (long prompts): the
fast path's caches are some 35 plain forwards' peaks (2.2 GB of RSS at 1,024 tokens on SmolLM2
for `resid_pre` at the last position of every layer), the lean path's one forward's plus the
sites. A sweep at late positions then runs each patched forward over every column: slower (the
fast path recomputes the columns from the patched one on), docs/long-context.md."""

LEAN_TIME = 1.6
"""Between `LEAN_MIN_BYTES` and `LEAN_ALWAYS_BYTES`: the most work (token-layers) the lean path may
cost over the fast path to be chosen. Token-layers undercount the fast path (it records both
runs' full caches and copies the KV prefix per row): on SmolLM2 at 1,025 tokens, `resid_pre` at
one layer and 3 positions (ratio 1.55) took 34 s on the fast path and 15 s on the lean one; every
position of every layer (ratio ~1.9) is 2.4x slower lean."""


LEAN_ROW_TOKENS = 1024
"""The lean path runs at most `max(1, LEAN_ROW_TOKENS // width)` rows per forward (and at most
`max_rows`), its two recorded runs included: on a long prompt each row is a forward's worth of
activations (9 rows of `head_out` at 1,024 tokens peaked at 9 forwards' memory), and one row of
1,024 tokens already fills the matrix products, so fewer rows cost no time."""


def lean_rows(max_rows: int, width: int, least: int = LEAN_ROW_TOKENS) -> int:
    """Rows per forward of the lean path on rows of `width` tokens (`LEAN_ROW_TOKENS`)."""
    return max(1, min(max_rows, least // max(1, width)))


def full_cache_bytes(
    g: dict[str, int],
    item: int,
    n: int,
    width: int,
    *,
    pattern: bool = False,
    query: bool = False,
    keys: bool = True,
) -> int:
    """Bytes one recorded run of the fast path keeps (`record.cache_bytes`): `n` rows of `width`
    tokens, `item` bytes per element, geometry `g` (`n_layers, n_heads, n_kv_heads, d_head,
    d_model`, as `heads.planning.plan.geometry` reads it)."""
    H, KV, d, D, L = g["n_heads"], g["n_kv_heads"], g["d_head"], g["d_model"], g["n_layers"]
    per = 3 * D + H * d + 2 * KV * d + ((H + 2 * KV) * d if keys else 0) + (H * d if query else 0)
    total = n * width * (L * per + D) * item
    if pattern:
        total += n * width * L * H * width * 4
    return int(total)


PATTERN_BLOCK_RESIDUALS = 0.25
"""A forward that patches a head's pattern on the lean path computes that layer in blocks of
`PATTERN_BLOCK_RESIDUALS x d_model / H` query rows (its edit's `block_rows`), so each fp32
`[rows, H, q, K]` block tensor holds a quarter of a residual-stream copy, whatever the prompt."""

PATTERN_BLOCK_COPIES = 4
"""fp32 block-sized tensors alive in such a block (the pattern, its edited copy, the mix, the
masked result)."""


def lean_kept_bytes(
    g: dict[str, int], item: int, kind: str, n: int, width: int, layers: Sequence[int], n_pos: int
) -> int:
    """Bytes the lean path keeps: both runs' sites at `layers` (`n_pos` positions for the
    by-position kinds; the kinds over every position, the source run's only: the base run keeps
    one bool per head) and the base run's residual entering each patched layer > 0; for `pattern`
    the source run's rotated queries and keys and the patched forward's pattern blocks
    (`PATTERN_BLOCK_RESIDUALS`)."""
    H, G, d, D = g["n_heads"], g["n_kv_heads"], g["d_head"], g["d_model"]
    extra = 0
    if kind in ("resid_pre", "mlp_out"):
        site = n_pos * D * item
    elif kind in ("attn_out", "head_out_by_pos"):
        site = n_pos * H * d * item
    elif kind == "pattern":  # the source's rotated queries and keys, the patched forward's blocks
        site = width * (H + G) * d * item // 2  # the base run keeps one bool per head
        q_rows = min(width, max(1, int(PATTERN_BLOCK_RESIDUALS * D) // H))
        extra = PATTERN_BLOCK_COPIES * 4 * min(n, lean_rows(64, width)) * H * q_rows * width
    elif kind in ("k", "v"):  # the source's; the base run keeps one bool per KV head
        site = width * G * d * item // 2
    else:  # head_out, q: the source's; the base run keeps one bool per head
        site = width * H * d * item // 2
    resid = sum(1 for la in layers if la) * width * D * item
    return int(n * (2 * len(layers) * site + resid)) + extra


def patch_work(
    n_layers: int, width: int, n: int, sites: Sequence[tuple[int, int]], by_pos: bool, lean: bool
) -> int:
    """Token-layers of a sweep over `sites` (`(layer, position)`, position -1 for the kinds that
    patch every position): the two recorded runs and one forward per (site, pair) from its
    layer (the fast path from its position on for the by-position kinds)."""
    rows = sum((width if lean or not by_pos else width - pos) * (n_layers - layer) for layer, pos in sites)
    return 2 * n * width * n_layers + n * rows


def lean_default(
    full: int,
    work_lean: int,
    work_full: int,
    *,
    least: int = LEAN_MIN_BYTES,
    always: int = LEAN_ALWAYS_BYTES,
    time: float = LEAN_TIME,
) -> bool:
    """The default path: lean where the full caches (`full` bytes, both runs) exceed `always`
    (`LEAN_ALWAYS_BYTES`), or exceed `least` (`LEAN_MIN_BYTES`) and its work is at most `time`
    (`LEAN_TIME`) times the fast path's; else the fast path."""
    if full > always:
        return True
    return full > least and work_lean <= time * max(1, work_full)


def patch_kept(
    g: dict[str, int],
    item: int,
    kind: str,
    n: int,
    width: int,
    layers: Sequence[int] | None,
    positions: Sequence[int] | None,
) -> tuple[bool, int]:
    """`(lean, bytes kept beside the forwards)` of the default path of `patch(kind, layers,
    positions)` on `n` pairs of `width` tokens (layers None: all; positions None: all, negative
    from the end)."""
    L = g["n_layers"]
    lays = list(range(L)) if layers is None else sorted(set(layers))
    by_pos = kind in BY_POSITION
    if by_pos:
        given = range(width) if positions is None else positions
        poss = sorted({p + width if p < 0 else p for p in given})
    else:
        poss = []
    heads = {"head_out_by_pos": g["n_heads"]}.get(kind, 1)
    if by_pos:
        sites = [(la, p) for la in lays for _ in range(heads) for p in poss]
    else:
        per_layer = g["n_kv_heads"] if kind in ("k", "v") else g["n_heads"]
        sites = [(la, -1) for la in lays for _ in range(per_layer)]
    keys = kind in ("k", "v")  # what the fast path records (`activation._run_full`)
    full = 2 * full_cache_bytes(g, item, n, width, pattern=kind == "pattern", query=kind == "q", keys=keys)
    lean = lean_default(
        full, patch_work(L, width, n, sites, by_pos, True), patch_work(L, width, n, sites, by_pos, False)
    )
    return lean, (lean_kept_bytes(g, item, kind, n, width, lays, len(poss)) if lean else full)

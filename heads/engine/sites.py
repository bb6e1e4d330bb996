"""The edit sites: what each `Edit.site` names, its TransformerLens hook name and its shape.

This table is data only. Where a site sits on a model is the backend's business
(`heads.backends.hf`: module hooks and the `transformers` attention interface; the
TransformerLens bridge's hook points; nnsight: the Hugging Face modules inside the trace), so
this module imports no backend and no model adapter.

Sites and what an edit there sees (B batch rows, T positions of the call, H query heads, G KV
heads, d head width, D d_model; `{l}` the layer):

| site | TransformerLens hook | tensor | notes |
|---|---|---|---|
| `embed` | `hook_embed` | `[B, T, D]` | token embedding module's output |
| `pos_embed` | `hook_pos_embed` | `[B, T, D]` | learned absolute positions (GPT-2) only |
| `residual` (`resid_pre`) | `blocks.{l}.hook_resid_pre` | `[B, T, D]` | the stream entering block l |
| `q` / `k` / `v` | `blocks.{l}.attn.hook_q/k/v` | `[B, T, H, d]` / `[B, T, G, d]` | before QK-norm, RoPE |
| `query` | `blocks.{l}.attn.hook_rot_q` | `[B, T, H, d]` | queries after QK-norm and RoPE |
| `rot_k` | `blocks.{l}.attn.hook_rot_k` | `[B, T, G, d]` | read only: the call's new keys, after RoPE |
| `logits` | `blocks.{l}.attn.hook_attn_scores` | `[B, H, Q, K]` | additive biases (`LogitBias`) |
| `attn_scores` | `blocks.{l}.attn.hook_attn_scores` | `[B, H, Q, K]` | read only, masked |
| `probs` (`pattern`) | `blocks.{l}.attn.hook_pattern` | `[B, H, Q, K]` | pattern edits and recorders |
| `head_output` (`z`) | `blocks.{l}.attn.hook_z` | `[B, T, H, d]` | the o_proj input, per head |
| `attn_out` | `blocks.{l}.hook_attn_out` | `[B, T, D]` | the value the attention adds to the stream |
| `resid_mid` | `blocks.{l}.hook_resid_mid` | `[B, T, D]` | sequential blocks only |
| `mlp_out` | `blocks.{l}.hook_mlp_out` | `[B, T, D]` | the value the MLP adds to the stream |
| `resid_post` | `blocks.{l}.hook_resid_post` | `[B, T, D]` | the stream leaving block l |
| `ln1.scale`, `ln2.scale` | `blocks.{l}.ln1.hook_scale`, `ln2` | `[B, T, 1]` | attention / MLP input norm |
| `ln1_post.scale`, ... | `blocks.{l}.ln1_post.hook_scale`, ... | `[B, T, 1]` | post-norms (Gemma 2 / 3) |
| `ln_final.scale` | `ln_final.hook_scale` | `[B, T, 1]` | the final norm's denominator (fp32) |
| `ln_final.normalized` | `ln_final.hook_normalized` | `[B, T, D]` | read only: input / scale (fp32) |

For the post-norm families (Gemma 2 / 3, OLMo 2 / 3, GLM-4) `attn_out` and `mlp_out` hold the
value that joins the residual stream, i.e. the output of the post-attention / post-MLP norm (as
TransformerLens' `hook_attn_out` / `hook_mlp_out`); the norm's input (the heads' summed output)
is `attn_out_pre_norm` / `mlp_out_pre_norm` (TransformerLens names `blocks.{l}.ln1_post.hook_in`,
`blocks.{l}.ln2_post.hook_in`). The model-level sites (`embed`, `pos_embed`, `ln_final.*`) take
`layer=0`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from heads.engine.edits import Edit

__all__ = ["ALIASES", "SITES", "Site", "site_of", "tl_hook_name"]


@dataclass(frozen=True)
class Site:
    """One edit site (see the module docstring).

    Attributes:
        name: the value of `Edit.site` this entry serves.
        hook: its TransformerLens hook name (`{l}` stands for the layer).
        shape: the tensor an edit there sees, in the shape letters of `heads`.
        attention: applied inside headsteer's attention function (the model's attention
            implementation is switched while such an edit is active).
        pattern_site: the layer must compute its attention itself (logits / probs), not call
            the model's own function.
        scope: `"layer"` (one per block) or `"model"` (one per model: `layer` is 0).
        heads: `"q"` (the tensor has an axis of query heads), `"kv"` (of KV heads) or None.
        replace: an edit there may return a replacement (else it only reads).
    """

    name: str
    hook: str
    shape: str
    attention: bool = False
    pattern_site: bool = False
    scope: str = "layer"
    heads: str | None = None
    replace: bool = True


SITES: dict[str, Site] = {
    s.name: s
    for s in (
        Site("query", "blocks.{l}.attn.hook_rot_q", "[B, T, H, d]", attention=True, heads="q"),
        Site(
            "rot_k", "blocks.{l}.attn.hook_rot_k", "[B, T, G, d]", attention=True, heads="kv", replace=False
        ),
        Site("logits", "blocks.{l}.attn.hook_attn_scores", "[B, H, Q, K]", attention=True, pattern_site=True),
        Site("probs", "blocks.{l}.attn.hook_pattern", "[B, H, Q, K]", attention=True, pattern_site=True),
        Site("head_output", "blocks.{l}.attn.hook_z", "[B, T, H, d]", heads="q"),
        Site("residual", "blocks.{l}.hook_resid_pre", "[B, T, D]"),
        Site("embed", "hook_embed", "[B, T, D]", scope="model"),
        Site("pos_embed", "hook_pos_embed", "[B, T, D]", scope="model"),
        Site("q", "blocks.{l}.attn.hook_q", "[B, T, H, d]", heads="q"),
        Site("k", "blocks.{l}.attn.hook_k", "[B, T, G, d]", heads="kv"),
        Site("v", "blocks.{l}.attn.hook_v", "[B, T, G, d]", heads="kv"),
        Site(
            "attn_scores",
            "blocks.{l}.attn.hook_attn_scores",
            "[B, H, Q, K]",
            attention=True,
            pattern_site=True,
            replace=False,
        ),
        Site("attn_out", "blocks.{l}.hook_attn_out", "[B, T, D]"),
        Site("attn_out_pre_norm", "blocks.{l}.ln1_post.hook_in", "[B, T, D]"),
        Site("resid_mid", "blocks.{l}.hook_resid_mid", "[B, T, D]"),
        Site("mlp_out", "blocks.{l}.hook_mlp_out", "[B, T, D]"),
        Site("mlp_out_pre_norm", "blocks.{l}.ln2_post.hook_in", "[B, T, D]"),
        Site("resid_post", "blocks.{l}.hook_resid_post", "[B, T, D]"),
        Site("ln1.scale", "blocks.{l}.ln1.hook_scale", "[B, T, 1]"),
        Site("ln2.scale", "blocks.{l}.ln2.hook_scale", "[B, T, 1]"),
        Site("ln1_post.scale", "blocks.{l}.ln1_post.hook_scale", "[B, T, 1]"),
        Site("ln2_post.scale", "blocks.{l}.ln2_post.hook_scale", "[B, T, 1]"),
        Site("ln_final.scale", "ln_final.hook_scale", "[B, T, 1]", scope="model"),
        Site("ln_final.normalized", "ln_final.hook_normalized", "[B, T, D]", scope="model", replace=False),
    )
}
"""Every edit site, keyed by `Edit.site`."""


ALIASES = {"resid_pre": "residual", "z": "head_output", "pattern": "probs"}
"""TransformerLens-style names accepted for three sites the engine had before the others."""


def site_of(e: Edit) -> Site:
    """The `SITES` entry of a validated edit (`validate_edits` checked its `site` is a key)."""
    return SITES[cast(str, e.site)]


def tl_hook_name(site: str, layer: int) -> str:
    """The TransformerLens hook name of `site` in `layer` (e.g. `blocks.3.hook_resid_mid`)."""
    return SITES[ALIASES.get(site, site)].hook.replace("{l}", str(layer))

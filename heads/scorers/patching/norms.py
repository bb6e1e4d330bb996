"""The frozen-scale convention for the norms of a forward (TransformerLens' `apply_ln_to_stack`):
a norm's scale fixed at its value in the run makes it linear, so a sum of parts through it is a
sum of terms. `norm_parts` reads what that needs of one norm module from its own function;
`post_attention_norm` and `head_terms` give each head's share of a post-norm family's attention
output (Gemma 2 / 3, OLMo 2 / 3, EXAONE 4, GLM-4, HyperCLOVA X: the attention output passes a norm
before it joins the residual stream), used by DLA and the per-head lens.
"""

from __future__ import annotations

import torch

from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.model.parts import submodule

# Internal to the patching analyses (importable by this module path, not public API, so not in
# the reference): `frozen_scale`, `head_terms`, `post_attention_norm`; `norm_parts` is exported
# by `heads.scorers.patching.logit`.
__all__: list[str] = []

NormParts = tuple[str, torch.Tensor, torch.Tensor | None, float]


def norm_parts(
    model: HeadModel, norm: torch.nn.Module, dim: int
) -> tuple[str, torch.Tensor, torch.Tensor | None, float]:
    """What the frozen-scale convention needs of one norm module of `model` (the final norm, a
    block's input or output norm, a QK-norm): `(kind, gain, bias, eps)`, with `kind` `"rms"`
    (RMSNorm: `gain * x / sqrt(mean(x^2) + eps)`) or `"layer"` (LayerNorm: centred, `var`),
    `gain` `[dim]` fp32, `bias` `[dim]` or None.

    The kind, gain and bias are read from the norm's own function, not from its class or its
    parameter names (Gemma's and Nemotron's norms multiply by `1 + weight`, OLMo's has no
    weight, Cohere's is a LayerNorm with an RMSNorm's attribute names): the norm is applied to
    `0` (which gives its bias), to a vector `x` of alternating +-1 and to `x + 3` (equal to `x`'s
    output iff the norm centres), and the gain is `(N(x) - N(0)) * sqrt(var + eps) / x_c`
    elementwise (`x_c` = `x` centred for a LayerNorm, `var` its mean square; no entry of `x_c`
    is 0). `eps` is the norm's `variance_epsilon` / `eps` attribute, or, for a norm that keeps it
    inside its forward (OLMo's 1e-5), solved from `N(a x) / N(x) = a sqrt(m + eps) / sqrt(a^2 m +
    eps)` at `a = 1e-3` (at most 1e-2). The read form is then checked against the norm on a
    vector it has not seen.

    Raises:
        ValueError: a norm without an eps attribute whose eps cannot be measured, or whose
            function is not the read RMSNorm / LayerNorm form (its scale cannot be frozen).
    """
    x = torch.ones(dim)
    x[1::2] = -1.0
    param = next(norm.parameters(), None)
    device, dtype = (param.device, param.dtype) if param is not None else (model.device, model.dtype)

    def run(v: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = norm(v[None].to(device, dtype))
            return out.float().cpu()[0]

    zero, at_x, shifted = run(torch.zeros(dim)), run(x), run(x + 3.0)
    centred = bool(torch.allclose(at_x, shifted, rtol=1e-2, atol=1e-3 * float(at_x.abs().max())))
    xc = x - x.mean() if centred else x
    ms = float(xc.pow(2).mean())
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    if eps is None:  # a constant inside forward (OLMo): N(a x) / N(x) = a sqrt(m + eps) / sqrt(a^2 m + eps)
        a = 1e-3
        r = float(((run(a * x) - zero) / (at_x - zero)).mean())
        eps = a * a * ms * (1 - r * r) / (r * r - a * a) if r * r != a * a else 0.0
        if not 0 < eps <= 1e-2:  # a norm's eps is small (1e-5, 1e-6); not a norm otherwise
            raise HeadsteerValueError(
                f"norm {type(norm).__name__} has no eps attribute and none could be measured (it does "
                "not divide by sqrt(mean(x^2) + eps)); cannot freeze its scale"
            )
    gain = (at_x - zero) * float((ms + float(eps)) ** 0.5) / xc
    bias = zero if bool(zero.abs().max() > 0) else None
    # the read form must be the norm's function: check it on a vector it has not seen
    v = torch.randn(dim, generator=torch.Generator().manual_seed(0)) * 3 + 0.5
    vc = v - v.mean() if centred else v
    want = gain * vc / float((vc.pow(2).mean() + float(eps)) ** 0.5) + (0.0 if bias is None else bias)
    got = run(v)
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
        raise HeadsteerValueError(
            f"norm {type(norm).__name__} is not an RMSNorm or a LayerNorm of its input (gain * x / "
            "sqrt(mean(x^2) + eps) + bias, x centred for a LayerNorm), so its scale cannot be frozen "
            f"(eps {'read' if hasattr(norm, 'eps') or hasattr(norm, 'variance_epsilon') else 'measured'}: "
            f"{float(eps):.3g})"
        )
    return ("layer" if centred else "rms"), gain, bias, float(eps)


def frozen_scale(kind: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x.shape[:-1]` the norm's reciprocal scale at each position, frozen at its value for `x`:
    `1 / sqrt(mean(x^2) + eps)` (`kind` `"rms"`) or `1 / sqrt(var(x) + eps)` (`"layer"`)."""
    if kind == "layer":
        return (x.var(-1, unbiased=False) + eps).rsqrt()
    return (x.pow(2).mean(-1) + eps).rsqrt()


def post_attention_norm(model: HeadModel, layer: int) -> NormParts | None:
    """`norm_parts` of block `layer`'s post-attention norm (the family's `attn_out_norm`), or None
    where the attention output joins the residual stream as it is (no such norm, or an identity:
    HyperCLOVA X without post norms).

    Raises:
        ValueError: the module is not an RMSNorm / LayerNorm whose scale can be frozen.
    """
    name = model.family.attn_out_norm
    if name is None:
        return None
    module = submodule(model.layers[layer], name)
    if isinstance(module, torch.nn.Identity):
        return None
    return norm_parts(model, module, model.d_model)


def head_terms(
    z: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    u: torch.Tensor,
    post: NormParts | None,
    attn: torch.Tensor | None = None,
    tol: float = 1e-3,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each head's share of one block's attention output projected on a direction, and the heads'
    shares summed.

    Without a post-attention norm head h adds `z_h W_O^h` to the stream. With one (`post`:
    `norm_parts` of it, scale frozen at its value in the run on the attention output
    `y = sum_h z_h W_O^h + b_O`), head h adds `gain * c(z_h W_O^h) / sigma(y)` (`c` centres for a
    LayerNorm); the norm's bias and `b_O`'s share are the rest of the output.

    Args:
        z: `[N, T, H, d]` head outputs (fp32).
        wo: `[H, d, D]` the output projection per head; `bo`: `[D]` its bias or None.
        u: `[N, D]` one direction per row (what the final norm's frozen scale multiplies).
        post: `norm_parts` of the post-attention norm, or None.
        attn: `[N, T, D]` the recorded attention output as it joins the stream (before any
            residual multiplier); with `post`, checked against the frozen-scale sum within
            `tol` times its largest entry (default 1e-3; looser for half-precision models).

    Returns:
        `(terms [N, H, T], head_sum [N, T, D] or None)`: `terms[n, h, t] = share_h(n, t) . u[n]`;
        `head_sum` the summed shares (only when `attn` is given).

    Raises:
        ValueError: `attn` is not the post-attention norm of `sum_h z_h W_O^h + b_O` (the norm
            does not read the heads' output: the family cannot be decomposed this way).
    """
    if post is None:
        terms = torch.einsum("nthd,nhd->nht", z, torch.einsum("hdk,nk->nhd", wo, u))
        return terms, None if attn is None else torch.einsum("nthd,hdk->ntk", z, wo)
    kind, gain, bias, eps = post
    proj = torch.einsum("nthd,hdk->ntk", z, wo)
    y = proj if bo is None else proj + bo
    inv = frozen_scale(kind, y, eps)  # [N, T]
    w = gain * u
    if kind == "layer":
        w = w - w.mean(-1, keepdim=True)  # c(v) . w = v . c(w)
    terms = torch.einsum("nthd,nhd->nht", z, torch.einsum("hdk,nk->nhd", wo, w)) * inv[:, None, :]
    if attn is None:
        return terms, None
    centred = proj - proj.mean(-1, keepdim=True) if kind == "layer" else proj
    head_sum = gain * centred * inv[..., None]
    yc = y - y.mean(-1, keepdim=True) if kind == "layer" else y
    want = gain * yc * inv[..., None] + (0.0 if bias is None else bias)
    if not torch.allclose(want, attn, rtol=0, atol=tol * max(float(attn.abs().max()), 1.0)):
        raise HeadsteerValueError(
            "the post-attention norm's output is not the norm of the heads' output projection "
            f"(off by {float((want - attn).abs().max()):.3g}); the heads' shares cannot be read under the "
            "frozen-scale convention"
        )
    return terms, head_sum

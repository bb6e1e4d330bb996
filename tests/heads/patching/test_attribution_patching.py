"""Attribution patching on pairs (`patch(..., method="attribution")`) against an independent
autograd oracle written here: one whole-model forward of the plain Hugging Face model with one
plain hook that swaps the site's activation for a leaf of the same value (so `leaf.grad` is
dM/da), the metric's backward, the source run's activation from the same hook, and
`M(base) + sum (a_source - a_base) . dM/da` (0 on left padding). Nothing of the product's engine
is used. On families with a sliding window shorter than the prompts, post-norms, GQA, parallel
blocks, soft-capping, learned sinks and absolute positions; both directions; both ways the source
run reaches the walk (recorded sites, recomputed checkpoints). Where the metric is linear in the
site the estimate equals activation patching; kinds it does not estimate are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from heads.scorers.patching import attribution as atp
from heads.scorers.patching.activation import patch
from heads.scorers.patching.request import ATTRIBUTION_KINDS, PatchRequest
from tests.heads.patching.test_family_patching import ANSWERS, COUNTER, _pairs
from tests.support import patching_oracle as oracle
from tests.support.families import shared_family_model, tiny_family_model

OPTS = SweepOptions(max_rows=64, progress=False)
POSITIONS = [3, 9, -1]
TOL = 1e-6  # relative to the scale of the metric (its largest |value| or gap, at least 1)
# post-norm families: the value joining the stream is the post-norm's output (hook_attn_out)
POST = {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"}
POST_NORM = {"gemma2", "gemma3_text", "olmo2"}
FAMILIES = [
    "llama",  # plain
    "qwen2",  # GQA, q/k/v biases
    "mistral",  # sliding window (6) shorter than the prompts
    "gemma2",  # post-norms, logit and attention soft-capping, sliding / global layers
    "gemma3_text",  # post-norms, QK-norm, sliding / global layers
    "olmo2",  # post-norms, key norm over all heads
    "gpt2",  # absolute positions, Conv1D, LayerNorm
    "phi",  # parallel blocks (attention and MLP read the same input)
    "gpt_oss",  # learned sinks, MoE, sliding layers
]


def _ld(logits: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(logits.shape[0])
    return logits[idx, torch.tensor(ANSWERS)] - logits[idx, torch.tensor(COUNTER)]


def _site_module(hm, family: str, kind: str, layer: int):
    if family in POST_NORM and kind in POST:
        return getattr(hm.layers[layer], POST[kind])
    return hm.attentions[layer] if kind == "attn_out" else oracle.mlp_module(hm, layer)


def _run(hm, family: str, ids, mask, kind: str, layer: int):
    """`(last logits [N, V] fp32, the site's activation as a leaf)` of one plain forward."""
    box: list[torch.Tensor] = []

    def leaf(x: torch.Tensor) -> torch.Tensor:
        a = x.detach().clone().requires_grad_(True)
        box.append(a)
        return a

    if kind == "resid_pre":
        module, how = hm.layers[layer], "pre_kw"

        def fn(mod, args, kwargs):
            if args:
                return (leaf(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": leaf(kwargs["hidden_states"])}

    elif kind in ("head_out", "head_out_by_pos"):
        module, how = hm.out_projs[layer], "pre"

        def fn(mod, args):
            return (leaf(args[0]), *args[1:])

    else:
        module, how = _site_module(hm, family, kind, layer), "post"

        def fn(mod, args, out):
            first = out[0] if isinstance(out, tuple) else out
            new = leaf(first)
            return (new, *out[1:]) if isinstance(out, tuple) else new

    h = (
        module.register_forward_pre_hook(fn, with_kwargs=True)
        if how == "pre_kw"
        else module.register_forward_pre_hook(fn)
        if how == "pre"
        else module.register_forward_hook(fn)
    )
    try:
        with oracle.oracle_attention(hm), torch.enable_grad():
            out = hm.model(
                input_ids=ids, attention_mask=mask, position_ids=oracle.position_ids(mask), use_cache=False
            )
    finally:
        h.remove()
    return out.logits[:, -1].float(), box[0]


def oracle_estimate(hm, family, pairs, kind, layer, positions, direction="denoising") -> torch.Tensor:
    """`[*cell, N]` the AtP estimate of `kind` at `layer` by autograd on the plain model."""
    base_ids, src_ids = (
        (pairs.corrupted_ids, pairs.clean_ids)
        if direction == "denoising"
        else (pairs.clean_ids, pairs.corrupted_ids)
    )
    mask = pairs.attention_mask
    logits, a = _run(hm, family, base_ids, mask, kind, layer)
    m = _ld(logits)
    m.sum().backward()
    with torch.no_grad():
        _, s = _run(hm, family, src_ids, mask, kind, layer)
    N, T = base_ids.shape
    prod = (s.detach() - a.detach()) * a.grad
    if kind in ("head_out", "head_out_by_pos"):
        prod = prod.reshape(N, T, hm.n_heads, -1)
    prod = prod.sum(-1) * mask.reshape(N, T, *([1] * (prod.dim() - 3)))  # [N, T] or [N, T, H]
    if kind == "head_out":
        cell = prod.sum(1)  # [N, H]
    elif kind == "head_out_by_pos":
        cell = prod[:, positions].transpose(1, 2)  # [N, H, P]
    else:
        cell = prod[:, positions]  # [N, P]
    return (m.detach().reshape(N, *([1] * (cell.dim() - 1))) + cell).movedim(0, -1)


def _check(hm, family, pairs, kind, direction="denoising"):
    pos = POSITIONS if kind != "head_out" else None
    res = patch(hm, pairs, kind, positions=pos, direction=direction, options=OPTS, method="attribution")
    assert res.params["method"] == "attribution"
    scale = max(1.0, float(res.raw.abs().max()), float((res.clean - res.corrupt).abs().max()))
    cols = res.params["positions"]
    for li, layer in enumerate(res.layer_ids):
        want = oracle_estimate(hm, family, pairs, kind, layer, cols, direction)
        err = float((res.raw[li] - want).abs().max())
        assert err <= TOL * scale, (family, kind, direction, layer, err)
    return res


@pytest.mark.filterwarnings("ignore:.*patching by position")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_kind_equals_the_autograd_oracle(family):
    hm = shared_family_model(family)
    pairs = _pairs()
    for kind in ATTRIBUTION_KINDS:
        _check(hm, family, pairs, kind)


@pytest.mark.filterwarnings("ignore:.*patching by position")
@pytest.mark.parametrize("source", ["record", "walk"])
@pytest.mark.parametrize("family", ["gemma2", "phi"])
def test_noising_and_both_source_paths_equal_the_oracle(family, source, monkeypatch):
    monkeypatch.setattr(atp, "SOURCE", source)
    hm = shared_family_model(family)
    pairs = _pairs()
    for kind in ("head_out", "resid_pre", "mlp_out"):
        for direction in ("denoising", "noising"):
            _check(hm, family, pairs, kind, direction)


@pytest.mark.filterwarnings("ignore:.*patching by position")
def test_metric_and_normalisation_as_patch():
    """The clean / corrupted metrics are patch's, and the normalised scores follow from raw as
    patch normalises them (the same PatchResult)."""
    hm = shared_family_model("llama")
    pairs = _pairs()
    act = patch(hm, pairs, "head_out", options=OPTS)
    est = patch(hm, pairs, "head_out", options=OPTS, method="attribution")
    assert type(est) is type(act) and est.grid == act.grid and est.raw.shape == act.raw.shape
    assert torch.allclose(est.clean, act.clean, atol=1e-6) and torch.allclose(
        est.corrupt, act.corrupt, atol=1e-6
    )
    want = (est.raw - est.corrupt) / (est.clean - est.corrupt)
    assert torch.allclose(est.scores, want, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*patching by position")
def test_linear_site_equals_activation_patching():
    """The last layer's MLP output at the last position reaches a logit difference linearly once
    the final RMSNorm is linear (its epsilon 1e30 swamps the mean square in fp32: x * w / 1e15,
    w = 1e17 so that the logits are not tiny):
    the first-order estimate is then exact, equal to activation patching."""
    hm = tiny_family_model("llama")
    norm = hm.model.model.norm
    norm.variance_epsilon = 1e30
    with torch.no_grad():
        norm.weight.fill_(1e17)
    pairs = _pairs()
    last = hm.n_layers - 1
    act = patch(hm, pairs, "mlp_out", layers=[last], positions=[-1], options=OPTS)
    est = patch(hm, pairs, "mlp_out", layers=[last], positions=[-1], options=OPTS, method="attribution")
    scale = max(1.0, float(act.raw.abs().max()))
    assert float((act.raw - act.corrupt).abs().max()) > 1e-3  # the site matters
    assert float((est.raw - act.raw).abs().max()) <= TOL * scale
    # a non-linear site (the residual entering the last layer) is only approximated
    act = patch(hm, pairs, "resid_pre", layers=[last], positions=[-1], options=OPTS)
    est = patch(hm, pairs, "resid_pre", layers=[last], positions=[-1], options=OPTS, method="attribution")
    assert float((est.raw - act.raw).abs().max()) > 1e-4


@pytest.mark.parametrize("kind", ["q", "k", "v", "pattern"])
def test_kinds_not_estimated_are_refused_by_name(kind):
    with pytest.raises(HeadsteerValueError, match=rf"does not estimate kind='{kind}'"):
        PatchRequest(kind=kind, method="attribution")
    hm = shared_family_model("llama")
    with pytest.raises(HeadsteerValueError, match="method='attribution' does not estimate"):
        patch(hm, _pairs(), kind, method="attribution", options=OPTS)
    with pytest.raises(HeadsteerValueError, match="method must be one of activation, attribution"):
        PatchRequest(method="gradient")


def test_kl_noising_estimate_is_refused_by_name():
    """KL(clean || run) has gradient 0 at the clean run: noising with KL estimated 0 everywhere and
    still returned a ranking (noise; breaker). Denoising with KL is kept."""
    with pytest.raises(HeadsteerValueError, match="gradient there is 0"):
        PatchRequest(kind="head_out", metric="kl", direction="noising", method="attribution")
    hm = shared_family_model("llama")
    with pytest.raises(HeadsteerValueError, match="gradient there is 0"):
        patch(hm, _pairs(), "head_out", metric="kl", direction="noising", method="attribution", options=OPTS)
    PatchRequest(kind="head_out", metric="kl", direction="denoising", method="attribution")
    PatchRequest(kind="head_out", metric="kl", direction="noising")


def test_family_refusals_apply_and_request_round_trips():
    hm = shared_family_model("opt")  # its MLP is not one module: mlp_out refused as by patch
    with pytest.raises(HeadsteerValueError, match="not one module"):
        patch(hm, _pairs(), "mlp_out", positions=[-1], method="attribution", options=OPTS)
    req = PatchRequest(kind="head_out", method="attribution")
    assert PatchRequest.from_json(req.to_json()) == req


def test_memory_plan_refuses_the_estimate_by_name():
    """The planner's activation-patching plan is not the estimate's: refused, not misplanned."""
    from heads.planning import plan_memory

    cfg = shared_family_model("llama").model.config
    assert plan_memory(cfg, PatchRequest(kind="head_out"), 32).peak > 0
    with pytest.raises(HeadsteerValueError, match=r"patch\(method='attribution'\) has no memory plan"):
        plan_memory(cfg, PatchRequest(kind="head_out", method="attribution"), 32)


@pytest.mark.filterwarnings("ignore:.*patching by position")
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_deeper_model_walks_segments_in_parts(parts, monkeypatch):
    """Six layers: three checkpoint segments (0, 3, 5), each segment of both runs recomputed in
    `parts` passes; every layer equals the oracle."""
    monkeypatch.setattr(atp, "SOURCE", "walk")
    monkeypatch.setattr(atp, "PARTS", parts)
    hm = tiny_family_model("llama", num_hidden_layers=6)
    pairs = _pairs()
    for kind in ("head_out", "mlp_out", "resid_pre"):
        _check(hm, "llama", pairs, kind)


@pytest.mark.filterwarnings("ignore:.*patching by position")
def test_one_pair_a_walk_trims_its_padding():
    """`max_rows=1`: each pair walks alone, the shorter one without its two padding columns (the
    scored columns shift by them); equal to the oracle and to one walk of both pairs."""
    hm = shared_family_model("qwen2")
    pairs = _pairs()
    one = SweepOptions(max_rows=1, progress=False)
    for kind in ("head_out", "head_out_by_pos", "attn_out", "resid_pre"):
        pos = None if kind == "head_out" else [1, 3, 9, -1]  # column 1: padding in pair 1
        res = patch(hm, pairs, kind, positions=pos, options=one, method="attribution")
        both = patch(hm, pairs, kind, positions=pos, options=OPTS, method="attribution")
        scale = max(1.0, float(res.raw.abs().max()))
        assert float((res.raw - both.raw).abs().max()) <= TOL * scale, kind
        for li, layer in enumerate(res.layer_ids):
            want = oracle_estimate(hm, "qwen2", pairs, kind, layer, res.params["positions"])
            assert float((res.raw[li] - want).abs().max()) <= TOL * scale, (kind, layer)


def test_max_memory_is_refused_not_ignored():
    hm = shared_family_model("llama")
    with pytest.raises(HeadsteerValueError, match="max_memory"):
        patch(hm, _pairs(), "head_out", method="attribution", options=SweepOptions(max_memory="1GB"))


def test_run_dispatches_the_method():
    """`heads.run(model, PatchRequest(method="attribution"), pairs)` (the CLI's and the server's
    path) runs the estimate, not activation patching (the dispatch copied the request's fields
    by hand and dropped `method`)."""
    from heads import run

    hm = shared_family_model("llama")
    pairs = _pairs()
    got = run(hm, PatchRequest(kind="head_out", method="attribution"), pairs, options=OPTS)
    want = patch(hm, pairs, "head_out", method="attribution", options=OPTS)
    assert got.params.get("method") == "attribution"
    assert torch.equal(got.raw, want.raw)


def test_attn_out_with_a_residual_multiplier_is_refused_before_any_forward():
    """MiniCPM3 scales each sub-layer's output before the stream: the engine's attn_out site,
    where the gradient is read, refuses it; the request refuses it first, from the config."""
    hm = shared_family_model("minicpm3")
    with pytest.raises(HeadsteerValueError, match="residual multiplier other than 1"):
        PatchRequest(kind="attn_out", method="attribution").check_config(hm)
    with pytest.raises(HeadsteerValueError, match="does not estimate kind='attn_out' with a residual"):
        patch(hm, _pairs(), "attn_out", positions=[-1], method="attribution", options=OPTS)

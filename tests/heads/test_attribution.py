"""Attribution patching (heads.scorers.safety.attribution) against exact ablations on tiny random models."""

import math

import pytest
import torch

from heads import HeadScale, QueryScale, editing, encode_prompts, forward
from heads.scorers.safety.attribution import (
    HeadReplace,
    attribute,
    logit_diff,
    sahara_candidates,
    target_logprob,
)
from heads.scorers.safety.ships import TEMPLATE, sahara, ships
from tests.support import make_tiny

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon and a knight.", "What is two plus two?"]
TARGETS, FOILS = [11, 200, 3000], [12, 201, 45]


@pytest.fixture(scope="module")
def linear_toy(tokenizer):
    """One layer, MLP output zero (down_proj = 0), final norm the identity: the logits are an
    affine function of the head outputs z, so a logit difference is linear in z and first
    order is exact for any change of z."""
    hm = make_tiny("llama", tokenizer, num_hidden_layers=1)
    with torch.no_grad():
        hm.layers[0].mlp.down_proj.weight.zero_()
    hm.model.model.norm = torch.nn.Identity()
    return hm


def _enc(hm):
    return encode_prompts(
        hm.tokenizer, [TEMPLATE.replace("{query}", p) for p in PROMPTS], chat=False, markup=False
    )


def _exact_effect(hm, edit_for, metric) -> torch.Tensor:
    """`[N, L, H]` metric(ablated) - metric(clean), one plain forward per head."""
    enc = _enc(hm)
    rows = torch.arange(enc.batch)

    def value(edits):
        with editing(hm, edits):
            logp = torch.log_softmax(forward(hm, enc)[:, -1].double(), -1)
        return metric(logp, rows).float()

    base = value([])
    out = torch.zeros(enc.batch, hm.n_layers, hm.n_heads)
    for layer in range(hm.n_layers):
        for head in range(hm.n_heads):
            out[:, layer, head] = value([edit_for(layer, head)]) - base
    return out


def _mean_values(hm, layer):
    enc = _enc(hm)
    got = []
    handle = hm.out_projs[layer].register_forward_pre_hook(lambda m, a: got.append(a[0]))
    forward(hm, enc)
    handle.remove()
    z = got[0].double() * enc.attention_mask[..., None]
    return (z.sum((0, 1)) / enc.attention_mask.sum()).float().reshape(hm.n_heads, hm.d_head)


@pytest.mark.parametrize("ablation", ["ua", "sc", "zero", "mean"])
def test_linear_toy_estimate_is_exact(linear_toy, ablation):
    hm = linear_toy
    metric = logit_diff(TARGETS, FOILS)
    eps = 0.3 if ablation == "sc" else 0.0

    def edit_for(layer, head):
        if ablation == "ua":
            return QueryScale(layer=layer, heads=[head], factor=eps)
        if ablation == "mean":
            return HeadReplace(layer=layer, heads=[head], values=_mean_values(hm, layer))
        return HeadScale(layer=layer, heads=[head], factor=eps)

    want = _exact_effect(hm, edit_for, metric)
    got = attribute(hm, PROMPTS, ablation=ablation, eps=eps, metric=metric)
    assert got.scores.method == "attribution"
    assert want.abs().max() > 1e-3  # the ablations do change the metric
    torch.testing.assert_close(got.per_prompt, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.scores.scores, want.mean(0), atol=2e-5, rtol=1e-4)


def test_linearised_softmax_is_the_derivative(linear_toy):
    """Without the saturation fix, UA's pattern change is the tangent of softmax(f s) at f = 1:
    exact for a tiny change of f (error O((1-f)^2)), visibly off for f = 0 (saturation)."""
    hm = linear_toy
    metric = logit_diff(TARGETS, FOILS)
    near = 0.999
    want = _exact_effect(hm, lambda la, h: QueryScale(layer=la, heads=[h], factor=near), metric)
    naive = attribute(hm, PROMPTS, eps=near, metric=metric, saturation_fix=False).per_prompt
    assert (naive - want).abs().max() <= 2e-3 * want.abs().max()
    far = _exact_effect(hm, lambda la, h: QueryScale(layer=la, heads=[h], factor=0.0), metric)
    naive_far = attribute(hm, PROMPTS, exact=True, metric=metric, saturation_fix=False).per_prompt
    fixed_far = attribute(hm, PROMPTS, exact=True, metric=metric).per_prompt
    torch.testing.assert_close(fixed_far, far, atol=2e-5, rtol=1e-4)
    assert (naive_far - far).abs().max() > 1e-2 * far.abs().max()


@pytest.mark.parametrize("kl_tokens", [1, 3])
def test_kl_estimate_is_the_coarse_kl_for_a_small_change(linear_toy, kl_tokens):
    """For a small SC change (eps = 0.98) the estimate equals the exact KL between the clean and
    ablated coarse-grained distributions (top-m tokens + rest) to first order in the change."""
    hm = linear_toy
    enc = _enc(hm)
    with torch.no_grad():
        base = torch.log_softmax(forward(hm, enc)[:, -1].double(), -1)
    top = base.topk(kl_tokens, -1).indices
    got = attribute(hm, PROMPTS, ablation="sc", eps=0.98, kl_tokens=kl_tokens)
    assert got.scores.method == "ships_attribution"

    def coarse(logp):
        p = logp.gather(-1, top).exp()
        return torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1)

    for head in range(hm.n_heads):
        with editing(hm, HeadScale(layer=0, heads=[head], factor=0.98)), torch.no_grad():
            abl = torch.log_softmax(forward(hm, enc)[:, -1].double(), -1)
        p, q = coarse(base), coarse(abl)
        want = (p * (p / q).log()).sum(-1).float()
        assert want.min() > 0
        torch.testing.assert_close(got.per_prompt[:, 0, head], want, rtol=0.05, atol=1e-12)


def test_kl_first_order_is_zero_and_estimate_non_negative(tiny_llama):
    """The estimate is >= 0 (a KL), 0 for an identity ablation, and ranks like the exact sweep."""
    est = attribute(tiny_llama, PROMPTS)
    assert (est.per_prompt >= 0).all() and est.scores.scores.max() > 0
    same = attribute(tiny_llama, PROMPTS, ablation="sc", eps=1.0)
    assert same.scores.scores.abs().max() < 1e-10
    exact = ships(tiny_llama, PROMPTS)
    a, b = exact.scores.scores.flatten(), est.scores.scores.flatten()
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    assert torch.corrcoef(torch.stack([ra, rb]))[0, 1] > 0.5


def test_custom_edit_matches_named_ablation(tiny_llama):
    named = attribute(tiny_llama, PROMPTS, exact=True, metric=target_logprob(TARGETS))
    custom = attribute(
        tiny_llama,
        PROMPTS,
        ablation=lambda layer: QueryScale(layer=layer, factor=0.0),
        metric=target_logprob(TARGETS),
    )
    torch.testing.assert_close(custom.per_prompt, named.per_prompt, atol=1e-7, rtol=0)
    assert custom.scores.params["ablation"] == "custom"


def test_graddrop_last_layer_is_the_plain_magnitude(tiny_llama):
    """GradDrop: for heads of the last layer, dropping any earlier layer leaves the gradient as
    it is and dropping their own layer zeroes it, so 1/(L-1) sum |.| = |plain estimate|."""
    metric = logit_diff(TARGETS, FOILS)
    plain = attribute(tiny_llama, PROMPTS, ablation="sc", eps=0.0, metric=metric)
    gd = attribute(tiny_llama, PROMPTS, ablation="sc", eps=0.0, metric=metric, graddrop=True)
    last = tiny_llama.n_layers - 1
    torch.testing.assert_close(gd.per_prompt[:, last], plain.per_prompt[:, last].abs(), atol=1e-7, rtol=1e-6)
    assert (gd.per_prompt >= 0).all()
    assert not torch.allclose(gd.per_prompt[:, 0], plain.per_prompt[:, 0].abs())  # paths do interact


@pytest.mark.parametrize("ablation", ["ua", "sc"])
def test_confirmation_returns_exact_scores(tiny_llama, ablation):
    full = ships(tiny_llama, PROMPTS, ablation=ablation)
    res = ships(tiny_llama, PROMPTS, ablation=ablation, method="attribution", confirm=3, controls=2, seed=1)
    est = attribute(tiny_llama, PROMPTS, ablation=ablation)
    confirmed = [tuple(h) for h in res.scores.params["confirmed"]]
    control = [tuple(h) for h in res.scores.params["controls"]]
    assert confirmed == est.scores.ranked(3)
    assert len(control) == 2 and not set(control) & set(confirmed)
    assert res.scores.method == "ships" and res.scores.params["method"] == "attribution"
    torch.testing.assert_close(res.estimate.scores, est.scores.scores)
    for layer, head in confirmed + control:
        torch.testing.assert_close(
            res.per_prompt[:, layer, head], full.per_prompt[:, layer, head], atol=1e-6, rtol=0
        )
    scored = ~torch.isnan(res.scores.scores)
    assert scored.sum() == 5
    again = ships(tiny_llama, PROMPTS, ablation=ablation, method="attribution", confirm=3, controls=2, seed=1)
    assert again.scores.params["controls"] == res.scores.params["controls"]


def test_confirm_zero_returns_the_estimate(tiny_llama):
    res = ships(tiny_llama, PROMPTS, method="attribution")
    assert res.scores.method == "ships_attribution" and res.estimate is res.scores
    assert not torch.isnan(res.scores.scores).any()


def test_heads_subset_and_batches(tiny_llama):
    full = attribute(tiny_llama, PROMPTS, max_rows=64)
    split = attribute(tiny_llama, PROMPTS, max_rows=1, heads=[(0, 1), (2, 3)])
    for layer, head in [(0, 1), (2, 3)]:
        torch.testing.assert_close(
            split.per_prompt[:, layer, head], full.per_prompt[:, layer, head], atol=1e-6, rtol=1e-4
        )
    assert torch.isnan(split.scores.scores[1]).all() and split.scores.scores[0, 1] >= 0


def test_model_unchanged_after_run_and_error(tiny_llama):
    enc = _enc(tiny_llama)
    before = forward(tiny_llama, enc)
    attribute(tiny_llama, PROMPTS, graddrop=True)
    with pytest.raises(ValueError, match="must return a"):
        attribute(tiny_llama, PROMPTS, metric=lambda logp, rows: logp[:, :2])
    assert torch.equal(forward(tiny_llama, enc), before)
    assert all(not p.grad_fn and p.grad is None for p in tiny_llama.model.parameters())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ablation="mean_q"), "unknown ablation"),
        (dict(metric="js"), "metric must be"),
        (dict(kl_tokens=0), "kl_tokens"),
        (dict(eps=2.0), "eps must be"),
        (dict(eps=math.nan), "eps must be"),
        (dict(max_rows=0), "max_rows"),
        (dict(heads=[(9, 0)]), "layer"),
        (dict(metric=target_logprob([1, 2])), "built for 2 prompts"),
        (dict(ablation=lambda layer: QueryScale(layer=0, factor=0.0)), "must return an Edit for layer"),
    ],
)
def test_attribute_bad_input(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        attribute(tiny_llama, PROMPTS, **kwargs)


def test_bad_flags_and_metric_builders(tiny_llama):
    with pytest.raises(TypeError, match="graddrop"):
        attribute(tiny_llama, PROMPTS, graddrop="yes")
    with pytest.raises(ValueError, match="differ in length"):
        logit_diff([1, 2], [3])
    with pytest.raises(ValueError, match="token ids"):
        target_logprob([1, -2])
    with pytest.raises(ValueError, match="token ids"):
        target_logprob("abc")
    with pytest.raises(ValueError, match="empty prompt"):
        attribute(tiny_llama, [])
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        attribute(tiny_llama, PROMPTS, metric=logit_diff([1, 2, 3], [4, 5, 99999]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="fast"), "method must be"),
        (dict(confirm=3), "confirm=3 needs method='attribution'"),
        (dict(method="attribution", confirm=-1), "confirm must be"),
        (dict(method="attribution", confirm=13), "confirm must be"),
        (dict(method="attribution", confirm=2, controls=1.5), "controls must be"),
        (dict(method="attribution", confirm=2, seed="x"), "seed must be"),
        (dict(method="attribution", confirm=2, shard=(0, 2)), "shard"),
    ],
)
def test_ships_attribution_bad_input(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ships(tiny_llama, PROMPTS, **kwargs)


def test_controls_beyond_the_heads_left_are_refused_not_cut(tiny_llama):
    """`controls` larger than the heads left after the confirmed ones was cut to them silently
    (`controls=2**63` ran with 10); now refused by value before any forward, by `ships`, the
    request and `confirm_ships`. The default (None: 10, fewer when fewer are left) still runs
    on a small head set, where `confirm_ships` used to refuse its own default."""
    from heads import run
    from heads.scorers.safety.attribution import confirm_ships
    from heads.scorers.safety.request import ShipsRequest

    n = tiny_llama.n_layers * tiny_llama.n_heads
    for bad in (2**63, n - 1):
        want = f"controls must be an int in 0..{n - 2} .*got {bad}"
        with pytest.raises(ValueError, match=want):
            ships(tiny_llama, PROMPTS, method="attribution", confirm=2, controls=bad)
        with pytest.raises(ValueError, match=want):
            run(tiny_llama, ShipsRequest(method="attribution", confirm=2, controls=bad), PROMPTS)
        with pytest.raises(ValueError, match=want):
            confirm_ships(tiny_llama, PROMPTS, confirm=2, controls=bad)
    few = [(0, 0), (0, 1), (1, 2), (2, 3), (2, 0)]
    res = confirm_ships(tiny_llama, PROMPTS, confirm=2, heads=few)
    assert len(res.scores.params["confirmed"]) == 2 and len(res.scores.params["controls"]) == 3
    res = ships(tiny_llama, PROMPTS, method="attribution", confirm=2, controls=n - 2, seed=1)
    assert len(res.scores.params["controls"]) == n - 2  # the most there are: every head left


def test_sahara_candidates_restrict_the_search(tiny_llama):
    cands = sahara_candidates(tiny_llama, PROMPTS, 4)
    assert cands == attribute(tiny_llama, PROMPTS).scores.ranked(4)
    res = sahara(tiny_llama, PROMPTS, steps=2, heads=cands)
    assert set(res.heads) <= set(cands)
    assert (~torch.isnan(res.steps[0].scores)).sum() == 4
    with pytest.raises(ValueError, match="k must be"):
        sahara_candidates(tiny_llama, PROMPTS, 0)
    with pytest.raises(ValueError, match="unknown ablation"):
        sahara_candidates(tiny_llama, PROMPTS, 2, ablation="mean")


def test_ships_result_view_of_a_metric_attribution_is_signed_and_ranked_by_magnitude():
    """A custom-metric attribution (`method="attribution"`) was shown as "mean KL (nats)" and
    ranked by signed value, hiding the heads estimated to help the metric most (the largest
    negative changes): labelled as a metric change and ranked by |change|; Ships' KL unchanged."""
    from heads import HeadScores
    from heads.results.safety import ShipsResult

    table = torch.tensor([[0.1, -0.9], [0.5, -0.2]])
    result = ShipsResult(table[None], HeadScores(table, "attribution"), None)
    text = repr(result)
    assert "mean estimated metric change top by |change| L0.H1 -0.9, L1.H0 0.5, L1.H1 -0.2" in text
    assert "KL" not in text and "mean estimated metric change" in result._repr_html_()
    kl = ShipsResult(table.abs()[None], HeadScores(table.abs(), "ships_attribution"), None)
    assert "mean KL (nats) top L0.H1 0.9, L1.H0 0.5, L1.H1 0.2" in repr(kl)


@pytest.mark.parametrize(
    ("graddrop", "metric", "max_rows"), [(False, "kl", 1), (True, "kl", 2), (True, "ld", 3)]
)
def test_progress_counts_the_walks(tiny_llama, graddrop, metric, max_rows):
    """`options.progress` gets `(done, total)` once per walk down the layers: one per batch, with
    GradDrop one per group of MAX_FLOWS // scalars dropped layers (KL: kl_tokens scalars)."""
    from heads import SweepOptions
    from heads.scorers.safety.atp import MAX_FLOWS

    calls: list[tuple[int, int]] = []
    m = "kl" if metric == "kl" else logit_diff(TARGETS, FOILS)
    attribute(
        tiny_llama,
        PROMPTS,
        metric=m,
        kl_tokens=2,
        graddrop=graddrop,
        options=SweepOptions(max_rows=max_rows, progress=lambda d, t: calls.append((d, t))),
    )
    batches = math.ceil(len(PROMPTS) / max_rows)
    per_group = MAX_FLOWS // (2 if metric == "kl" else 1)
    walks = math.ceil(tiny_llama.n_layers / per_group) if graddrop else 1
    assert calls == [(d, batches * walks) for d in range(1, batches * walks + 1)]

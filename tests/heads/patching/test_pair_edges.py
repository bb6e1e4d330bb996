"""Pairs at the edges (issue 39 items 1, 4, 6): answers of different token counts, pairs that cannot
show an effect, the mean over pairs, and patching from several threads at once."""

from __future__ import annotations

import threading

import pytest
import torch

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from heads.scorers.patching import (
    PromptPair,
    direct_logit_attribution,
    logit_lens,
    pairs_from_tokens,
    path_patch,
)
from heads.scorers.patching.activation import KINDS, PatchResult, patch
from heads.scorers.patching.pairs import check_pairs_differ
from tests.support import patching_oracle as oracle
from tests.support.families import shared_family_model
from tests.support.patching import state_copy

OPTS = SweepOptions(max_rows=64, progress=False)
ANSWERS = [[20, 25], [30]]  # pair 0 has two answer tokens, pair 1 one: its second slot is padding
COUNTER = [[21], [31, 33]]


def _pairs():
    clean = [[40, 41, 42, 43, 44, 45, 46], [50, 51, 52, 53, 54]]
    corrupted = [[40, 41, 49, 43, 44, 45, 46], [50, 58, 52, 53, 54]]
    return pairs_from_tokens(clean, corrupted, ANSWERS, COUNTER)


def _ld(logits: torch.Tensor) -> torch.Tensor:
    """`[..., N]`: each pair's mean answer logit minus its mean counterfactual logit (its own tokens
    only), from `[..., N, V]`."""
    rows = []
    for i, (a, c) in enumerate(zip(ANSWERS, COUNTER, strict=True)):
        rows.append(logits[..., i, a].mean(-1) - logits[..., i, c].mean(-1))
    return torch.stack(rows, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_answers_of_different_token_counts_equal_the_loop(kind):
    """Padded answer slots were read as NaN x 0 (the sweeps compute only the answer columns), so
    the pairs with fewer tokens got NaN and the mean skipped them."""
    hm = shared_family_model("llama")
    pairs = _pairs()
    by_pos = kind in ("resid_pre", "attn_out", "mlp_out", "head_out_by_pos")
    res = patch(hm, pairs, kind, positions=[2, -1] if by_pos else None, options=OPTS)
    assert not torch.isnan(res.raw).any()
    poss = res.params["positions"]
    for li, layer in enumerate(res.params["layers"]):
        if by_pos and kind != "head_out_by_pos":
            sites = [(-1, p) for p in poss]
        elif kind == "head_out_by_pos":
            sites = [(h, p) for h in range(hm.n_heads) for p in poss]
        else:
            sites = [(h, -1) for h in range(res.raw.shape[1])]
        want = _ld(
            oracle.patch_loop(
                hm, pairs.corrupted_ids, pairs.clean_ids, pairs.attention_mask, kind, layer, sites
            )
        )
        assert float((res.raw[li].reshape(len(sites), -1) - want).abs().max()) <= 1e-5
    assert not torch.isnan(res.mean).any()


def test_path_patching_with_answers_of_different_token_counts():
    hm = shared_family_model("llama")
    pairs = _pairs()
    res = path_patch(hm, pairs, options=OPTS)
    senders = [(la, h) for la in range(hm.n_layers) for h in range(hm.n_heads)]
    logits = oracle.path_to_logits_loop(
        hm, pairs.clean_ids, pairs.corrupted_ids, pairs.attention_mask, senders
    )
    assert not torch.isnan(res.raw).any()
    assert float((res.raw.reshape(len(senders), -1) - _ld(logits)).abs().max()) <= 1e-5


def test_the_mean_averages_the_same_pairs_in_every_cell():
    """A cell with a NaN score in a kept pair is NaN, not the mean of the other pairs; a pair with
    no gap (clean == corrupt) is left out of every cell."""
    raw = torch.tensor([[1.0, 2.0, 5.0], [float("nan"), 4.0, 5.0]])  # 2 sites x 3 pairs
    clean, corrupt = torch.tensor([2.0, 6.0, 7.0]), torch.tensor([0.0, 2.0, 7.0])  # pair 2: no gap
    res = PatchResult("head_out", "denoising", "logit_diff", raw, clean, corrupt, ("site",))
    want0 = ((1.0 - 0.0) / 2.0 + (2.0 - 2.0) / 4.0) / 2
    assert res.mean[0].item() == pytest.approx(want0)
    assert torch.isnan(res.mean[1])  # pair 0's NaN is not skipped
    lo, hi = res.interval()
    assert lo[0] < want0 < hi[0] and torch.isnan(lo[1])


# ------------------------------------------------------------------------------ no effect possible
@pytest.fixture()
def counted():
    hm = shared_family_model("llama")
    calls: list[int] = []
    h = hm.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield hm, calls
    h.remove()


def test_pairs_that_cannot_show_an_effect_are_refused_before_any_forward(counted):
    hm, calls = counted
    same = pairs_from_tokens([[40, 41, 42], [50, 51, 52]], [[40, 44, 42], [50, 51, 52]], [20, 30], [21, 31])
    for run in (lambda p: patch(hm, p, "head_out"), lambda p: path_patch(hm, p)):
        with pytest.raises(HeadsteerValueError, match=r"pair 1 \(clean tokens \[50, 51, 52\]\).*same text"):
            run(same)
    echo = pairs_from_tokens([[40, 41, 42]], [[40, 44, 42]], [[20, 22]], [[22, 20]])
    with pytest.raises(HeadsteerValueError, match="pair 0 .*counterfactual is the answer"):
        patch(hm, echo, "resid_pre")
    assert not calls
    patch(hm, echo, "head_out", metric="log_prob", options=OPTS)  # a metric that never reads it
    assert calls


def test_the_shared_check_names_the_pair_by_its_text():
    ok = PromptPair("The cat sat", "The dog sat", " on", " in")
    with pytest.raises(HeadsteerValueError, match=r"pair 1 \(clean 'A b', corrupted 'A b'\).*same text"):
        check_pairs_differ([ok, PromptPair("A b", "A b", " c", " d")])
    with pytest.raises(HeadsteerValueError, match="pair 0 .*counterfactual is the answer"):
        check_pairs_differ([PromptPair("A b", "A c", " d", [" d"])])
    check_pairs_differ([PromptPair("A b", "A c", " d", " d")], counterfactual=False)


# ------------------------------------------------------------------------------ threads
def test_patch_path_patch_dla_and_lens_from_threads_give_their_single_thread_results():
    hm = shared_family_model("llama")
    pairs = _pairs()
    before = state_copy(hm)
    jobs = {
        "head_out": lambda: patch(hm, pairs, "head_out", options=OPTS).raw,
        "resid_pre": lambda: patch(hm, pairs, "resid_pre", options=OPTS).raw,
        "path": lambda: path_patch(hm, pairs, options=OPTS).raw,
        "dla": lambda: direct_logit_attribution(hm, pairs).heads,
        "lens": lambda: logit_lens(hm, pairs).logit_diff,
    }
    alone = {name: fn() for name, fn in jobs.items()}
    got: dict[tuple[str, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(name: str, rounds: int = 3) -> None:
        try:
            for r in range(rounds):
                got[(name, r)] = jobs[name]()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (name, _), raw in got.items():
        torch.testing.assert_close(raw, alone[name], atol=1e-6, rtol=0, equal_nan=True)
    assert all(torch.equal(v, before[k]) for k, v in hm.model.state_dict().items())
    assert all("forward" not in layer.__dict__ for layer in hm.layers)  # no swapped forward left
    torch.testing.assert_close(patch(hm, pairs, "head_out", options=OPTS).raw, alone["head_out"])


def test_one_pair_has_no_interval():
    """With one pair (with a gap) the standard error is undefined: the interval is NaN, not the
    point itself (it collapsed onto the mean, as if the score were certain: newcomer)."""
    raw = torch.tensor([[1.0, 3.0], [0.5, 7.0]])  # 2 sites x 2 pairs; pair 1 has no gap
    clean, corrupt = torch.tensor([2.0, 7.0]), torch.tensor([0.0, 7.0])
    res = PatchResult("head_out", "denoising", "logit_diff", raw, clean, corrupt, ("site",))
    assert res.mean.tolist() == pytest.approx([0.5, 0.25])
    lo, hi = res.interval()
    assert torch.isnan(lo).all() and torch.isnan(hi).all()
    frame = res.to_frame()
    assert frame["ci_low"].isna().all() and not frame["score"].isna().any()


def test_the_interval_uses_students_t_for_few_pairs():
    """Two pairs: mean +- t(0.975, 1) = 12.71 standard errors (it was 1.96, the normal
    approximation, far too narrow for the few pairs patching studies run: newcomer); `z=` keeps
    the normal interval; a bad `z` is refused by name."""
    raw = torch.tensor([[1.0, 3.0]])  # 1 site x 2 pairs
    clean, corrupt = torch.tensor([4.0, 4.0]), torch.tensor([0.0, 0.0])
    res = PatchResult("head_out", "denoising", "logit_diff", raw, clean, corrupt, ("site",))
    m, se = 0.5, 0.25  # normalised scores 0.25 and 0.75: sd 0.3536, standard error 0.25
    lo, hi = res.interval()
    assert float(res.mean[0]) == pytest.approx(m)
    assert float(hi[0] - m) == pytest.approx(12.7062 * se, rel=1e-4)
    assert float(m - lo[0]) == pytest.approx(12.7062 * se, rel=1e-4)
    lo, hi = res.interval(z=1.96)
    assert float(hi[0] - m) == pytest.approx(1.96 * se)
    with pytest.raises(HeadsteerValueError, match="z"):
        res.interval(z=-1)

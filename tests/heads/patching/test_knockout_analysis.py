"""`heads.knockout`: the logit difference with attention from query to key positions blocked (or
scaled) in chosen layers / heads equals a hand-written masked attention (the eager oracle of
`tests.support.oracle`, whose post-softmax hook zeroes or scales the chosen (query, key) pairs of
the chosen heads and layers and renormalises each row), per pair and per cell."""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from heads.results.knockout import KnockoutResult
from heads.scorers.patching import pairs_from_tokens
from heads.scorers.patching.knockout import knockout
from tests.support.oracle import llama_forward

OPTS = SweepOptions(max_rows=5, progress=False)  # odd: cells straddle forwards


def _pairs():
    clean = [[40, 41, 42, 43, 44, 45, 46, 47], [50, 51, 52, 53, 54, 55]]
    corrupted = [[40, 41, 49, 43, 44, 45, 46, 47], [50, 58, 52, 53, 54, 55]]
    # named positions in the unpadded prompt: IO, S1
    return pairs_from_tokens(
        clean, corrupted, [[20], [30]], [[21], [31]], positions={"IO": [2, 1], "S1": [4, 3]}
    )


def _oracle(hm, pairs, layers, heads, keys, factor):
    """`[N]` logit difference of the clean prompts with END's attention to `keys [N, T]` scaled."""
    ids, mask = pairs.clean_ids, pairs.attention_mask

    def transform(la, p):
        if la not in layers:
            return p
        B, H, T, K = p.shape
        q = torch.zeros(B, T, dtype=torch.bool)
        q[:, -1] = True
        hsel = torch.zeros(H, dtype=torch.bool)
        hsel[list(range(H)) if heads is None else list(heads)] = True
        sel = hsel[None, :, None, None] & q[:, None, :, None] & keys[:, None, None, :]
        out = torch.where(sel, p * factor, p)
        return out / out.sum(-1, keepdim=True)

    logits = llama_forward(hm.model, ids, mask, transform)[:, -1].float()
    n = torch.arange(pairs.n)
    return logits[n, pairs.answers[:, 0]] - logits[n, pairs.counterfactuals[:, 0]]


def _key_mask(pairs, names):
    m = torch.zeros(pairs.n, pairs.width, dtype=torch.bool)
    for name in names:
        m[torch.arange(pairs.n), pairs.position(name)] = True
    return m


@pytest.mark.parametrize(("per", "factor"), [("all", 0.0), ("head", 0.0), ("layer", 0.5)])
def test_knockout_equals_masked_attention(tiny_llama, per, factor):
    pairs = _pairs()
    before = {k: v.clone() for k, v in tiny_llama.model.state_dict().items()}
    res = knockout(
        tiny_llama, pairs, {"IO": "IO", "S": ["S1"]}, layers=[1, 2], per=per, factor=factor, options=OPTS
    )
    assert isinstance(res, KnockoutResult)
    torch.testing.assert_close(
        res.baseline, _oracle(tiny_llama, pairs, set(), None, _key_mask(pairs, []), 1.0), atol=1e-5, rtol=0
    )
    H = tiny_llama.n_heads
    want_cells = {
        "all": [((1, 2), None)],
        "layer": [((1,), None), ((2,), None)],
        "head": [((la,), (h,)) for la in (1, 2) for h in range(H)],
    }[per]
    assert res.cells == want_cells
    for c, names in enumerate((["IO"], ["S1"])):
        keys = _key_mask(pairs, names)
        for s, (layers, heads) in enumerate(res.cells):
            want = _oracle(tiny_llama, pairs, set(layers), heads, keys, factor)
            torch.testing.assert_close(res.knocked[c, s], want, atol=1e-5, rtol=0)
    assert float(res.effect().abs().max()) > 1e-4  # it changes the prediction
    assert all(torch.equal(v, before[k]) for k, v in tiny_llama.model.state_dict().items())
    # [L, H] view: each head holds its cell's mean effect, heads in no cell NaN
    hs = res.head_scores("S")
    assert torch.isnan(hs.scores[0]).all() and not torch.isnan(hs.scores[1]).any()
    frame = res.to_frame()
    assert len(frame) == 2 * len(res.cells)
    assert (frame["effect_lo"] <= frame["effect"]).all() and (frame["effect"] <= frame["effect_hi"]).all()


def test_knockout_round_trips_and_refuses_bad_input(tiny_llama, tmp_path):
    pairs = _pairs()
    res = knockout(tiny_llama, pairs, "IO", layers=[0], options=OPTS)
    path = res.save(tmp_path / "k.json")
    back = KnockoutResult.load(path, tiny_llama)
    assert (
        torch.equal(back.knocked, res.knocked)
        and back.cells == res.cells
        and back.keys == {"knockout": ["IO"]}
    )
    with pytest.raises(ValueError, match="exists"):
        res.save(path)
    with pytest.raises(HeadsteerValueError, match="unknown position 'XX'"):
        knockout(tiny_llama, pairs, "XX", options=OPTS)
    with pytest.raises(HeadsteerValueError, match="layers: unknown layer 9"):
        knockout(tiny_llama, pairs, "IO", layers=[9], options=OPTS)
    with pytest.raises(HeadsteerValueError, match="factor must be"):
        knockout(tiny_llama, pairs, "IO", factor=-1.0)
    with pytest.raises(HeadsteerValueError, match="blocks every visible key"):  # END's own column blocked too
        knockout(tiny_llama, pairs, list(range(8)), options=OPTS)

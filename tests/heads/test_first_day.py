"""Follow-up helpers of a first day (issue 40, item 3): signed top-k, readable HeadSet repr."""

import pytest
import torch

from heads import HeadScores, HeadSet


def test_top_by_abs_ranks_signed_scores_by_magnitude():
    t = torch.tensor([[0.1, -3.0, 2.0], [float("nan"), -0.5, 1.0]])
    s = HeadScores(t, "signed")
    # independent oracle: sort the finite cells by |value|, ties by (layer, head)
    cells = [(abs(v), (i, j)) for i, row in enumerate(t.tolist()) for j, v in enumerate(row) if v == v]
    want = [ij for _, ij in sorted(cells, key=lambda c: (-c[0], c[1]))]
    assert s.ranked(by="abs") == want
    assert s.top(2, by="abs") == HeadSet([(0, 1), (0, 2)])
    assert s.top(2) == HeadSet([(0, 2), (1, 2)])  # the default still ranks by the signed score
    assert s.top(1, by="-score") == HeadSet([(0, 1)])
    assert s.per_layer(1, by="abs") == HeadSet([(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="by must be one of"):
        s.top(2, by="magnitude")


def test_headset_repr_has_int_layers():
    hs = HeadSet([(24, 4), (20, 0), (24, 7)])
    assert repr(hs) == "HeadSet(3 heads: {20: [0], 24: [4, 7]})"
    assert hs.to_dict() == {"20": [0], "24": [4, 7]}  # the JSON shape keeps PASTA's string keys


# ---------------------------------------------------------------- evaluate_pairs
def _oracle_ld(model, pairs, transform=None):
    """Per pair, alone and unpadded, through the hand-written Llama forward: LD at the last token."""
    from tests.support.oracle import llama_forward

    out = []
    for p in pairs:
        ids = torch.tensor([model.tokenizer(p.clean)["input_ids"]])
        logits = llama_forward(model.model, ids, torch.ones_like(ids), transform)[0, -1]
        a, c = (
            model.tokenizer(x, add_special_tokens=False)["input_ids"][0] for x in (p.answer, p.counterfactual)
        )
        out.append(float(logits[a] - logits[c]))
    return torch.tensor(out)


def _uniform(heads):
    """Oracle of UA ablation: the chosen heads attend uniformly to their allowed (causal) keys."""

    def transform(layer, p):
        for la, h in heads:
            if la == layer:
                allowed = (p[:, h] > 0).float()
                p = p.clone()
                p[:, h] = allowed / allowed.sum(-1, keepdim=True)
        return p

    return transform


def test_evaluate_pairs_equals_an_oracle_plain_and_ablated(tiny_llama):
    from scipy import stats

    from heads import evaluate_pairs
    from heads.scorers.patching import encode_pairs
    from steer import Ablate
    from tests.support.patching import PAIRS

    pairs3 = [*PAIRS, PAIRS[0]]
    pairs = encode_pairs(tiny_llama, pairs3)
    ev = evaluate_pairs(tiny_llama, pairs, batch_size=2)
    want = _oracle_ld(tiny_llama, pairs3)
    torch.testing.assert_close(ev.logit_diff, want, atol=1e-4, rtol=1e-4)
    assert ev.accuracy == pytest.approx(float((want > 0).float().mean()))
    # the intervals, from their textbook formulas
    k, n, z = int((want > 0).sum()), 3, 1.959963984540054
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    assert ev.accuracy_ci == pytest.approx((max(0, centre - half), min(1, centre + half)))
    lo, hi = stats.t.interval(
        0.95, n - 1, loc=float(want.double().mean()), scale=stats.sem(want.double().numpy())
    )
    assert ev.logit_diff_ci == pytest.approx((lo, hi), rel=1e-5)
    heads = [(0, 1), (1, 0), (1, 3)]
    abl = evaluate_pairs(tiny_llama, pairs, steer=[Ablate(heads)])
    torch.testing.assert_close(
        abl.logit_diff, _oracle_ld(tiny_llama, pairs3, _uniform(heads)), atol=1e-4, rtol=1e-4
    )
    assert not torch.allclose(abl.logit_diff, ev.logit_diff)
    assert "Ablate" in abl.steer[0] and "accuracy" in repr(abl)
    assert list(abl.to_frame().columns) == ["pair", "logit_diff", "correct", "top1"]


def test_evaluate_pairs_bad_input(tiny_llama):
    from heads import evaluate_pairs
    from heads.scorers.patching import PromptPair, encode_pairs

    pairs = encode_pairs(
        tiny_llama,
        [PromptPair("Then Anna and Tom left. Tom thanked", "Then Anna and Tom left. Anna thanked", " Anna")],
    )
    with pytest.raises(ValueError, match="counterfactual"):
        evaluate_pairs(tiny_llama, pairs)
    with pytest.raises(TypeError, match="PairBatch"):
        evaluate_pairs(tiny_llama, ["a pair"])
    from tests.support.patching import PAIRS

    good = encode_pairs(tiny_llama, PAIRS)
    with pytest.raises(ValueError, match="which"):
        evaluate_pairs(tiny_llama, good, which="noisy")
    with pytest.raises(TypeError, match="steer"):
        evaluate_pairs(tiny_llama, good, steer=["ablate"])
    with pytest.raises(ValueError, match="level"):
        evaluate_pairs(tiny_llama, good, level=1.0)


# ---------------------------------------------------------------- named positions
def _ioi_pair(**positions):
    from heads.scorers.patching import PromptPair

    clean = "When Mary and John went to the store, John gave a drink to"
    corrupted = "When Mary and John went to the store, Mary gave a drink to"
    return PromptPair(clean, corrupted, " Mary", " John", positions=positions)


def _short_pair(**positions):
    from heads.scorers.patching import PromptPair

    clean, corrupted = "Then Anna and Tom left. Tom thanked", "Then Anna and Tom left. Anna thanked"
    return PromptPair(clean, corrupted, " Anna", " Tom", positions=positions)


def test_pairs_carry_named_positions(tokenizer):
    from heads.scorers.patching import encode_pairs
    from probes.datasets.pairs import load_task_pairs

    short = _short_pair(IO="Anna", S1=[14, 17], S2=[24, 27])
    b = encode_pairs(tokenizer, [_ioi_pair(IO="Mary", S1=[14, 18], S2=[38, 42]), short])
    assert b.position_names == ["END", "IO", "S1", "S2"]
    for row, (io, s) in enumerate((("Mary", "John"), ("Anna", "Tom"))):
        ids = b.clean_ids[row]
        want_io, want_s = (tokenizer(" " + w, add_special_tokens=False)["input_ids"][0] for w in (io, s))
        assert int(ids[b.position("IO")[row]]) == want_io
        assert int(ids[b.position("S1")[row]]) == int(ids[b.position("S2")[row]]) == want_s
        assert b.position("S1")[row] < b.position("S2")[row] < b.position("END")[row] == b.width - 1
    assert b.tokens[0][-1] == "\u2423to" and not any("\u0120" in t for t in b.tokens[0])  # readable, not Ġto
    sub = b.select([1])  # re-trimmed: the columns move with the padding
    assert sub.width < b.width and int(sub.position("IO")[0]) == int(b.position("IO")[1]) - (
        b.width - sub.width
    )
    # the shipped sets carry theirs
    ioi = load_task_pairs("ioi", n=3)
    enc = encode_pairs(tokenizer, ioi)
    for row, p in enumerate(ioi):
        assert enc.position_labels(row)[int(enc.position("IO")[row])] == "\u2423" + p.meta["io"]
        assert enc.position_labels(row)[int(enc.position("S2")[row])] == "\u2423" + p.meta["s"]
    co = encode_pairs(tokenizer, load_task_pairs("colored_objects", n=2))
    assert co.position_labels(0)[int(co.position("COLOR")[0])].strip("\u2423") == co.pairs[0].answer.strip()
    assert encode_pairs(tokenizer, load_task_pairs("comp_mech", n=2)).position_names == ["END", "OLD", "NEW"]


def test_named_positions_bad_input(tokenizer):
    from heads.scorers.patching import encode_pairs

    b = encode_pairs(tokenizer, [_ioi_pair(IO="Mary")])
    with pytest.raises(ValueError, match="unknown position 'S9': these pairs carry END, IO"):
        b.position("S9")
    with pytest.raises(ValueError, match="not in the clean prompt"):
        encode_pairs(tokenizer, [_ioi_pair(IO="Zoe")])
    with pytest.raises(ValueError, match="character span"):
        encode_pairs(tokenizer, [_ioi_pair(IO=[5, 500])])
    with pytest.raises(ValueError, match="END"):
        encode_pairs(tokenizer, [_ioi_pair(END="to")])
    mixed = encode_pairs(tokenizer, [_ioi_pair(IO="Mary"), _ioi_pair()])
    with pytest.raises(ValueError, match="pair 1 has no position 'IO'"):
        mixed.position("IO")


def test_position_attention_equals_an_oracle(tiny_llama):
    from heads import position_attention
    from heads.scorers.patching import encode_pairs
    from tests.support.oracle import llama_forward

    short = _short_pair(IO="Anna")
    items = [_ioi_pair(IO="Mary"), short]
    pairs = encode_pairs(tiny_llama, items)
    got = position_attention(tiny_llama, pairs, "END", "IO", batch_size=1)
    want = torch.zeros(tiny_llama.n_layers, tiny_llama.n_heads)
    for row, p in enumerate(items):  # each pair alone, unpadded, through the hand-written forward
        ids = torch.tensor([tiny_llama.tokenizer(p.clean)["input_ids"]])
        pats = {}

        def keep(layer, probs, pats=pats):
            pats[layer] = probs
            return probs

        llama_forward(tiny_llama.model, ids, torch.ones_like(ids), keep)
        k = int(pairs.position("IO")[row]) - (pairs.width - ids.shape[1])
        for la, probs in pats.items():
            want[la] += probs[0, :, -1, k] / len(items)
    torch.testing.assert_close(got.scores, want, atol=1e-5, rtol=1e-4)
    assert got.params["query"] == "END" and got.method == "position_attention"
    with pytest.raises(ValueError, match="comes after"):
        position_attention(tiny_llama, pairs, "IO", "END")


def test_patch_frame_shows_readable_tokens(tiny_llama):
    from heads.inputs.tokens import readable_tokens
    from heads.scorers.patching import encode_pairs
    from heads.scorers.patching.activation import patch
    from tests.support.patching import PAIRS

    pairs = encode_pairs(tiny_llama, PAIRS[:1])
    fr = patch(tiny_llama, pairs, "resid_pre", layers=[0]).to_frame()
    ids = tiny_llama.tokenizer(PAIRS[0].clean)["input_ids"]
    assert fr["token"].tolist() == readable_tokens(tiny_llama.tokenizer, ids)  # "␣to", never "Ġto"
    assert fr["token"].iloc[-1] == "\u2423to"

"""Pattern injection (docs/methods/pattern_injection.md) and pattern discovery on tiny random models.

The oracle re-computes the forward by hand (`tests.support.oracle.llama_forward`) and applies the
written rule to the post-softmax attention with target patterns built here from the definitions,
token by token (no headsteer pattern code), the reference's two modes included:
synthesize ("mix" at w = 1: uniform over the support) and mask (the head's own attention
restricted to the support).
"""

from __future__ import annotations

import re
import warnings

import pandas as pd
import pytest
import torch

from heads import encode_prompts, forward
from heads.engine.context import editing
from heads.engine.edits import Recorder
from heads.scorers.roles.clusters import name_clusters, pattern_clusters, pattern_features, record_pattern
from heads.scorers.roles.named import PatternContext, named_support, sentence_ids
from steer import SteeredModel
from steer.noop import NoOpWarning
from steer.pattern_injection import PatternInjection, inject_pattern
from tests.support import make_tiny
from tests.support.oracle import llama_forward

PROMPTS = [
    "The cat sat. The dog ran! Then **the bird** flew\nover the cat and the dog.",
    "A short one. **Yes** it is.",
]
NAMES = ["previous-token", "first-token", "attend-to-span", "same-sentence", "matching-token"]


@pytest.fixture(scope="module")
def llama(tokenizer):
    return make_tiny("llama", tokenizer, num_hidden_layers=2)


def _enc(model, prompts=PROMPTS):
    return encode_prompts(model.tokenizer, prompts, chat=False)


# ----------------------------------------------------------------------------- oracle
def _oracle_support(name: str, tok, enc, b: int) -> torch.Tensor:
    """`[P, P]` bool support of row b, from the written definitions (prompt rows only)."""
    p = enc.length
    real = enc.attention_mask[b].bool().tolist()
    first = real.index(True)
    ids = enc.input_ids[b].tolist()
    sup = torch.zeros(p, p, dtype=torch.bool)
    texts = [tok.decode([t]) for t in ids]
    sent, sid, ended = [-1] * p, 0, False
    for i in range(first, p):
        if ended:
            sid += 1
        sent[i] = sid
        t = texts[i]
        ended = "\n" in t or t.rstrip().endswith((".", "!", "?"))
    span = set()
    for t0, t1 in enc.spans[b]:
        span |= set(range(t0, t1))
    for i in range(first, p):
        for j in range(first, i + 1):
            on = {
                "previous-token": j == i - 1,
                "first-token": j == first,
                "attend-to-span": j in span,
                "same-sentence": sent[i] == sent[j],
                "matching-token": j < i and ids[j] == ids[i],
            }[name]
            sup[i, j] = on
    return sup


def _oracle_logits(model, enc, heads: dict[int, list[int]], name: str, w: float, mode: str):
    sups = torch.stack([_oracle_support(name, model.tokenizer, enc, b) for b in range(enc.batch)])  # [B,P,P]

    def transform(layer, probs):
        if layer not in heads:
            return probs
        out = probs.clone()
        for h in heads[layer]:
            for b in range(enc.batch):
                for i in range(enc.length):
                    s = sups[b, i]
                    if not s.any():
                        continue
                    a = probs[b, h, i]
                    if mode == "mix":
                        goal = s.float() / s.sum()
                    else:
                        goal = a * s / (a * s).sum()
                    out[b, h, i] = (1 - w) * a + w * goal
        return out

    return llama_forward(model.model, enc.input_ids, enc.attention_mask, transform)


@pytest.mark.parametrize(
    "name, mode", [(n, "mix") for n in NAMES] + [("same-sentence", "mask"), ("matching-token", "mask")]
)
def test_matches_oracle(llama, name, mode):
    enc = _enc(llama)
    heads = {0: [1], 1: [0, 3]}
    got = None
    with editing(llama, PatternInjection(heads, name, weight=0.6, mode=mode).edits(llama, enc)):
        got = forward(llama, enc)
    want = _oracle_logits(llama, enc, heads, name, 0.6, mode)
    real = enc.attention_mask.bool()
    assert torch.allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[real], forward(llama, enc)[real], atol=1e-3)  # the edit acted


def test_sentence_ids_rule():
    toks = ["A", " b", ".", " C", "!", '"', " D", "\n", "E", "?)", " F"]
    real = torch.tensor([True] * len(toks))
    assert sentence_ids(toks, real).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4]
    pad = torch.tensor([False, False] + [True] * (len(toks) - 2))
    assert sentence_ids(toks, pad).tolist()[:3] == [-1, -1, 0]


# ----------------------------------------------------------------------------- invariants
def _recorded(model, enc, edits, layer):
    rec = Recorder(layer=layer)
    with editing(model, [*edits, rec]):
        logits = forward(model, enc)
    return torch.cat(rec.records, dim=2), logits


def test_weight_zero_is_bitwise_noop_and_warns(llama):
    enc = _enc(llama)
    base = forward(llama, enc)
    with pytest.warns(NoOpWarning, match="no-op"):
        pi = PatternInjection({0: [0]}, "first-token", weight=0.0)
    assert pi.edits(llama, enc) == []
    e = PatternInjection({0: [0]}, "first-token").edits(llama, enc)[0]
    e.weight = torch.zeros(enc.batch)
    assert e.is_identity()
    with editing(llama, [e]):
        assert torch.equal(forward(llama, enc), base)


def test_weight_one_sets_pattern_rows_sum_to_one_gqa(llama):
    enc = _enc(llama)
    base_pat, _ = _recorded(llama, enc, [], 1)
    pat, _ = _recorded(llama, enc, PatternInjection({1: [2]}, "same-sentence").edits(llama, enc), 1)
    ctx = PatternContext.of(enc, llama.tokenizer)
    sup = named_support("same-sentence", ctx, 0, enc.length, enc.length, torch.device("cpu")).float()
    goal = sup / sup.sum(-1, keepdim=True).clamp(min=1)
    real = enc.attention_mask.bool()
    for b in range(enc.batch):
        rows = real[b]
        assert torch.allclose(pat[b, 2][rows], goal[b][rows], atol=1e-6)
        assert torch.allclose(pat[b, 2][rows].sum(-1), torch.ones(int(rows.sum())), atol=1e-6)
        assert (pat[b, 2][:, ~rows] == 0).all()  # padding keys stay 0
        assert (pat[b, 2].triu(1) == 0).all()  # future keys stay 0
    # GQA 4:2: head 3 shares head 2's KV head and is bitwise unchanged, so are heads 0 and 1
    for h in (0, 1, 3):
        assert torch.equal(pat[:, h], base_pat[:, h])


def test_first_row_without_support_is_unchanged(llama):
    enc = _enc(llama, PROMPTS[:1])
    base_pat, _ = _recorded(llama, enc, [], 0)
    pat, _ = _recorded(llama, enc, PatternInjection({0: [0]}, "previous-token").edits(llama, enc), 0)
    assert torch.equal(pat[0, 0, 0], base_pat[0, 0, 0])  # no previous token: unchanged
    assert pat[0, 0, 1, 0] == 1.0  # the second token attends only the first


def test_left_padding_batch_order_and_restore(llama):
    enc = _enc(llama)
    base = forward(llama, enc)
    edits = PatternInjection({0: [0, 1], 1: [2]}, "same-sentence", weight=0.8).edits(llama, enc)
    with editing(llama, edits):
        both = forward(llama, enc)
    for b, p in enumerate(PROMPTS):
        alone = _enc(llama, [p])
        with editing(
            llama, PatternInjection({0: [0, 1], 1: [2]}, "same-sentence", weight=0.8).edits(llama, alone)
        ):
            one = forward(llama, alone)
        real = enc.attention_mask[b].bool()
        assert torch.allclose(both[b][real], one[0], atol=1e-5)
    rev = _enc(llama, PROMPTS[::-1])
    with editing(llama, PatternInjection({0: [0, 1], 1: [2]}, "same-sentence", weight=0.8).edits(llama, rev)):
        flipped = forward(llama, rev)
    r0 = enc.attention_mask[0].bool()
    r1 = rev.attention_mask[1].bool()
    assert torch.allclose(both[0][r0], flipped[1][r1], atol=1e-5)
    assert torch.equal(forward(llama, enc), base)  # restored after the context


@pytest.mark.parametrize("name", ["same-sentence", "matching-token"])
def test_kv_cache_decoding_matches_full_recompute(llama, name):
    sm = SteeredModel(llama)
    pi = PatternInjection({0: [0, 3], 1: [1]}, name, weight=0.9)
    kw = dict(max_new_tokens=6, chat=False, progress=False)
    cached = sm.generate(PROMPTS, pi, **kw)
    full = sm.generate(PROMPTS, pi, use_cache=False, **kw)
    assert cached.token_ids == full.token_ids
    plain = sm.generate(PROMPTS, [], **kw)
    assert plain.token_ids != cached.token_ids  # the injection changed the continuation


def test_decode_rows_follow_the_named_rule(llama):
    """The decode row of a cached step gets exactly the previous-token pattern at w = 1."""
    enc = _enc(llama, PROMPTS[:1])
    ctx = PatternContext.of(enc, llama.tokenizer)
    p = enc.length
    sup = named_support("previous-token", ctx, p, 1, p + 1, torch.device("cpu"))
    assert sup[0, 0].nonzero().flatten().tolist() == [p - 1]
    # a prompt ending a sentence: generated tokens open a new one; else they continue the last one
    closed = named_support("same-sentence", ctx, p, 1, p + 1, torch.device("cpu"))[0, 0]
    assert not closed[:p].any() and bool(closed[p])
    enc2 = _enc(llama, ["The cat sat. The dog"])
    ctx2 = PatternContext.of(enc2, llama.tokenizer)
    p2 = enc2.length
    open_ = named_support("same-sentence", ctx2, p2, 1, p2 + 1, torch.device("cpu"))[0, 0]
    assert open_[:p2].tolist() == (ctx2.sentence[0] == 1).tolist() and bool(open_[p2])
    assert int(open_[:p2].sum()) == 2  # " The", " dog"


def test_template_recorded_from_another_model(llama, tokenizer):
    other = make_tiny("qwen2", tokenizer, num_hidden_layers=2)
    prompt = PROMPTS[0]
    tpl = record_pattern(other, prompt, 1, 3)
    enc = _enc(llama, [prompt])
    assert tpl.shape == (enc.length, enc.length)
    pat, _ = _recorded(llama, enc, PatternInjection({1: [0]}, tpl).edits(llama, enc), 1)
    assert torch.allclose(pat[0, 0], tpl, atol=1e-6)
    # in a left-padded batch the template follows each row's own tokens
    enc2 = _enc(llama, [PROMPTS[1], prompt])
    pat2, _ = _recorded(llama, enc2, PatternInjection({1: [0]}, tpl).edits(llama, enc2), 1)
    assert torch.allclose(pat2[1, 0], tpl, atol=1e-6)
    # the shorter row uses the template's first rows, renormalised over its own tokens
    t = int(enc2.attention_mask[0].sum())
    off = enc2.length - t
    sub = tpl[:t, :t] / tpl[:t, :t].sum(-1, keepdim=True)
    assert torch.allclose(pat2[0, 0, off:, off:], sub, atol=1e-6)


def test_inject_pattern_rule():
    a = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    vis = torch.tensor([[True, True, True, False], [True, True, True, True]])
    p = torch.tensor([[0.0, 2.0, 2.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    out = inject_pattern(a, p, vis, 0.5)
    assert torch.allclose(out[0], torch.tensor([0.25, 0.4, 0.35, 0.0]))
    assert torch.equal(out[1], a[1])  # no support: unchanged
    m = inject_pattern(a, p, vis, 1.0, "mask")
    assert torch.allclose(m[0], torch.tensor([0.0, 0.6, 0.4, 0.0]))


def test_bad_input(llama):
    enc = _enc(llama)
    with pytest.raises(ValueError, match="unknown pattern"):
        PatternInjection({0: [0]}, "next-token")
    with pytest.raises(ValueError, match="weight"):
        PatternInjection({0: [0]}, weight=1.5)
    with pytest.raises(TypeError, match="weight"):
        PatternInjection({0: [0]}, weight="1")
    with pytest.raises(ValueError, match="mode"):
        PatternInjection({0: [0]}, mode="set")
    for bad, msg in [
        (torch.ones(3, 4), r"\[T, T\]"),
        (-torch.ones(3, 3), "negative"),
        (torch.full((3, 3), float("nan")), "NaN"),
        (torch.zeros(3, 3), "all zero"),
    ]:
        with pytest.raises(ValueError, match=msg):
            PatternInjection({0: [0]}, bad)
    with pytest.raises(TypeError, match="pattern"):
        PatternInjection({0: [0]}, 3)
    with pytest.raises(ValueError, match="layer|head"):
        PatternInjection({5: [0]}).edits(llama, enc)
    with pytest.raises(ValueError, match="rows"):
        PatternInjection({0: [0]}, torch.ones(3, 5, 5)).edits(llama, enc)
    plain = encode_prompts(llama.tokenizer, ["no span here"], chat=False)
    with pytest.raises(ValueError, match="span"):
        PatternInjection({0: [0]}, "attend-to-span").edits(llama, plain)
    with pytest.raises(ValueError, match="one prompt"):
        record_pattern(llama, enc, 0, 0)
    with pytest.raises(ValueError, match="n_clusters"):
        pattern_clusters(llama, PROMPTS, n_clusters=0)


# ----------------------------------------------------------------------------- discovery
def test_name_clusters_rule():
    cent = pd.DataFrame(
        {
            "previous-token": [0.9, 0.1, 0.2, 0.85],
            "first-token": [0.05, 0.2, 0.3, 0.1],
            "same-sentence": [0.95, 0.6, 0.5, 0.9],
            "entropy": [0.1, 0.8, 0.3, 0.2],
        }
    )
    uniform = {"previous-token": 0.1, "first-token": 0.1, "same-sentence": 0.55}
    names = name_clusters(cent, ["previous-token", "first-token", "same-sentence", "entropy"], uniform)
    # same-sentence has the higher mass but a uniform head already puts 0.55 there
    assert names == ["previous-token", "diffuse", "mixed", "previous-token-2"]


def test_discovery_finds_and_names_a_planted_pattern(llama):
    enc = _enc(llama)
    planted = PatternInjection({1: [2]}, "previous-token").edits(llama, enc)
    with editing(llama, planted):
        feats = pattern_features(llama, enc)
        pc = pattern_clusters(llama, enc, n_clusters=2)
    row = feats[(feats["layer"] == 1) & (feats["head"] == 2)].iloc[0]
    assert row["previous-token"] == pytest.approx(1.0, abs=1e-6)
    assert (1, 2) in pc.heads("previous-token").heads
    assert pc.frame.shape[0] == llama.n_layers * llama.n_heads
    with pytest.raises(ValueError, match="no cluster"):
        pc.heads("induction")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pc.head_scores("entropy").scores.shape == (2, 4)


def test_sentence_regex_matches_module(tokenizer):
    """The module's end-of-sentence rule and the oracle's agree on the prompts' tokens."""
    ids = tokenizer(PROMPTS[0])["input_ids"]
    toks = [tokenizer.decode([t]) for t in ids]
    mod = sentence_ids(toks, torch.ones(len(toks), dtype=torch.bool)).tolist()
    ours, sid, ended = [], 0, False
    for t in toks:
        if ended:
            sid += 1
        ours.append(sid)
        ended = "\n" in t or bool(re.search(r"[.!?]\s*$", t))
    assert mod == ours and max(mod) >= 3

"""QKAttribution's views, files and invariants; bad input refused before any forward."""

from __future__ import annotations

import pytest
import torch

from heads import QKAttribution, qk_attribution
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.qk import attribution as attribution_module
from tests.support import make_tiny


@pytest.fixture(scope="module")
def llama(tokenizer):
    return make_tiny("llama", tokenizer, initializer_range=0.2)


@pytest.fixture(scope="module")
def result(llama):
    prompts = ["The cat sat on the mat and the cat", "One two three four"]
    return qk_attribution(llama, prompts, (2, 1), query=[-1, -2], by="source_token")


def test_invariants(result, llama):
    r = result
    assert r.kv_head == 0 and r.names[-1] == "bias" and r.names[0] == "embed"
    assert r.names[1:5] == ["L0H0", "L0H1", "L0H2", "L0H3"] and "1_mlp_out" in r.names
    assert r.max_error() < 1e-5
    v = r.valid
    # the marginals of either side and the pair table all sum to the score
    for m in (r.query_marginals(), r.key_marginals()):
        assert (m.sum(-1)[v] - r.score()[v]).abs().max() < 1e-6
    n, q = 1, int(r.queries[1, 0])
    t = r.terms(n, q, 0)
    assert float(t.sum()) == pytest.approx(float(r.score()[n, 0, 0]), abs=1e-6)
    assert torch.allclose(t.sum(1), r.query_marginals()[n, 0, 0], atol=1e-6)
    # prompt 1 is shorter: its keys past the query are not cells
    assert int(r.queries[1, 0]) == len(r.tokens[1]) - 1
    assert (r.keys[1] == -1).sum() == r.keys.shape[1] - len(r.tokens[1])
    assert torch.isnan(r.logits[~v]).all() and not torch.isnan(r.logits[v]).any()
    # the pattern is the model's own: visible keys of one row sum to 1 (keys = every position)
    row = r.pattern[0, 0][r.visible[0, 0]]
    assert float(row.sum()) == pytest.approx(1.0, abs=1e-5)
    # the source split sums to each head's marginal
    idx = [r.names.index(h) for h in r.source_heads]
    for side in ("query", "key"):
        split = r.sources[side].sum(-1)
        assert (split - r.marginals(side)[..., idx])[v].abs().max() < 1e-5
    # a source after the destination position carries nothing (causal patterns)
    assert r.sources["key"][0, 0, 3, :, 4:].abs().max() < 1e-12


def test_views(result):
    r = result
    pairs = r.top_pairs(3, prompt=0, key=2)
    assert len(pairs) == 3 and abs(pairs[0][2]) >= abs(pairs[1][2]) >= abs(pairs[2][2])
    assert pairs[0][0] in r.names and pairs[0][1] in r.names
    hs = r.head_scores("key")
    assert hs.scores.shape == (3, 4) and torch.isnan(hs.scores[2]).all()
    c = r.names.index("L1H2")
    assert float(hs.scores[1, 2]) == pytest.approx(float(r.key_marginals()[..., c][r.valid].mean()))
    src = r.top_sources("key", 4, prompt=0, key=5)
    assert len(src) == 4 and src[0][0] in r.source_heads and 0 <= src[0][1] <= 5
    df = r.to_frame()
    assert set(df.columns) == {"prompt", "query", "key", "side", "component", "value"}
    assert len(df) == int(r.valid.sum()) * 2 * len(r.names)
    assert len(r.to_frame("pairs")) == int(r.valid.sum()) * len(r.names) ** 2
    s = r.to_frame("sources")
    assert set(s.columns) >= {"head", "source", "source_token"}
    assert "QKAttribution(" in repr(r) and "L2H1" in repr(r)
    with pytest.raises(HeadsteerValueError, match="not in this result"):
        r.terms(0, 3)
    with pytest.raises(HeadsteerValueError, match="kind must be"):
        r.to_frame("bogus")


def test_files(result, llama, tokenizer, tmp_path):
    path = result.save(tmp_path / "qk.json")
    back = QKAttribution.load(path, llama)
    assert back.names == result.names and back.tokens == result.tokens
    assert torch.equal(back.queries, result.queries) and torch.equal(back.keys, result.keys)
    assert torch.allclose(back.q_side, result.q_side.float()) and back.max_error() < 1e-4
    assert torch.equal(back.visible, result.visible)
    assert torch.allclose(back.sources["key"], result.sources["key"].float())
    with pytest.raises(ValueError, match="exists"):
        result.save(path)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    with pytest.raises(ValueError, match="symlink"):
        result.save(link, overwrite=True)
    assert not (tmp_path / "target.json").exists()
    with pytest.raises(ValueError, match="n_layers"):
        QKAttribution.load(path, make_tiny("gpt2", tokenizer))
    text = path.read_text().replace('"scale": ', '"scale": "x", "was": ')
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match="malformed"):
        QKAttribution.load(bad)
    with pytest.raises(FileNotFoundError):
        QKAttribution.load(tmp_path / "missing.json")


def test_padding_does_not_change_a_prompt(llama):
    short = "One two three four"
    alone = qk_attribution(llama, [short], (1, 3), query=-1)
    batched = qk_attribution(llama, ["The cat sat on the mat and the cat", short], (1, 3), query=-1)
    n = len(alone.tokens[0])
    assert torch.allclose(alone.q_side[0], batched.q_side[1], atol=1e-6)
    assert torch.allclose(alone.k_side[0], batched.k_side[1, :, :n], atol=1e-6)


def test_head_as_headscores_prints_it(llama):
    ids = torch.randint(10, 1000, (6,), generator=torch.Generator().manual_seed(0))
    a, b = qk_attribution(llama, ids, "L1.H2"), qk_attribution(llama, ids, (1, 2))
    assert torch.equal(a.score(), b.score()) and a.head == b.head


def test_explicit_keys_and_ids(llama):
    ids = torch.randint(10, 1000, (12,), generator=torch.Generator().manual_seed(0))
    r = qk_attribution(llama, ids, "1.2", query=11, keys=[0, 5, -2])
    assert r.keys.tolist() == [[0, 5, 10]] and r.queries.tolist() == [[11]]
    full = qk_attribution(llama, ids, (1, 2), query=11)
    assert torch.allclose(r.score()[0, 0], full.score()[0, 0, [0, 5, 10]], atol=1e-6)


BAD = [
    (dict(head=(3, 0)), "unknown layer 3"),
    (dict(head=(0, 4)), "unknown head 4"),
    (dict(head="1:2"), "L.H"),
    (dict(head="9" * 5000 + ".1"), "L.H"),  # no int-string-limit error
    (dict(head="\u00b9.2"), "L.H"),  # a superscript digit is not a layer number
    (dict(head="L1.2"), "L.H"),
    (dict(query=12), "query position 12 is outside prompt 0"),
    (dict(query=-13), "outside prompt 0"),
    (dict(query=5, keys=[6]), "is after query 5"),
    (dict(keys=[12]), "key position 12 is outside"),
    (dict(query=[3, 3]), "repeat"),
    (dict(query=[]), "non-empty list"),
    (dict(query="last"), "position"),
    (dict(by="token"), "by must be one of"),
    (dict(prompts=""), "empty"),
    (dict(prompts=[]), "empty"),
    (dict(prompts=torch.tensor([], dtype=torch.long)), "empty"),
    (dict(prompts=torch.tensor([5, 99999])), "token ids must be in"),
]


@pytest.mark.parametrize(("kw", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line_before_any_forward(llama, monkeypatch, kw, message):
    def no_forward(*a, **k):
        raise AssertionError("a forward ran before the input was checked")

    monkeypatch.setattr(attribution_module, "record", no_forward)
    args = dict(prompts=torch.arange(10, 22), head=(1, 0))
    args.update(kw)
    prompts, head = args.pop("prompts"), args.pop("head")
    with pytest.raises(HeadsteerValueError, match=message) as info:
        qk_attribution(llama, prompts, head, **args)
    assert "\n" not in str(info.value)


def test_bad_types(llama):
    with pytest.raises(HeadsteerTypeError, match="head must be"):
        qk_attribution(llama, "hi there", 3)
    with pytest.raises(HeadsteerTypeError, match="integer tensor"):
        qk_attribution(llama, torch.ones(3), (0, 0))
    with pytest.raises(HeadsteerTypeError, match="HeadModel"):
        qk_attribution(object(), "hi", (0, 0))


def test_model_unchanged(llama):
    ids = torch.arange(10, 20)[None]
    before = llama.model(input_ids=ids).logits
    qk_attribution(llama, ids, (2, 3), by="source_token")
    assert torch.equal(llama.model(input_ids=ids).logits, before)


@pytest.mark.parametrize("by", ["component", "source_token"])
def test_many_heads_from_one_forward_equal_one_at_a_time(llama, by):
    from heads.scorers.qk import qk_attributions

    prompts = ["The cat sat on the mat and the cat", "One two three four"]
    heads = [(2, 1), (1, 3), (2, 0)]
    many = list(qk_attributions(llama, prompts, heads, query=[-1, -3], by=by))
    assert [(r.layer, r.head) for r in many] == sorted(heads)
    for r in many:
        one = qk_attribution(llama, prompts, (r.layer, r.head), query=[-1, -3], by=by)
        # an earlier layer whose logits are read runs the engine's explicit attention: float
        # rounding (~1e-7) apart from the model's own kernel, so the sides agree to 1e-6
        assert torch.allclose(r.q_side, one.q_side, atol=1e-6) and torch.allclose(
            r.k_side, one.k_side, atol=1e-6
        )
        assert torch.equal(r.logits.isnan(), one.logits.isnan())
        assert torch.allclose(r.logits.nan_to_num(), one.logits.nan_to_num(), atol=1e-6)
        assert torch.allclose(r.pattern.nan_to_num(), one.pattern.nan_to_num(), atol=1e-6)
        assert r.max_error() < 1e-5
        if by == "source_token":
            assert torch.allclose(r.sources["key"], one.sources["key"], atol=1e-6)
    assert len(list(qk_attributions(llama, "a b c", None))) == 12
    with pytest.raises(HeadsteerValueError, match="heads must be"):
        qk_attributions(llama, "a b c", [])

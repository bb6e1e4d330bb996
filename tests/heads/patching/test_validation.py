"""Bad input to the patching scorers: one-line HeadsteerValueError / HeadsteerTypeError naming
the bad value, before any forward; tampered result files refused field by field."""

from __future__ import annotations

import json

import pytest
import torch

from heads import SweepOptions
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.patching import (
    direct_logit_attribution,
    head_logits,
    logit_inspection,
    logit_lens,
    pairs_from_tokens,
    path_patch,
)
from heads.scorers.patching.activation import PatchResult, patch
from tests.support import make_tiny

BAD = (HeadsteerValueError, HeadsteerTypeError)
OPTS = SweepOptions(max_rows=16, progress=False)


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_tiny("llama", tokenizer)


@pytest.fixture()
def no_forward(model):
    calls: list[int] = []
    h = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield
    h.remove()
    assert not calls, "a forward ran before the bad input was refused"


def _ok():
    return pairs_from_tokens([[1, 5, 6], [1, 7, 8]], [[1, 9, 6], [1, 10, 8]], [2, 3], [4, 5])


# ------------------------------------------------------------------------------ token ids
@pytest.mark.parametrize(
    "args, match",
    [
        (([[1, -3]], [[1, 3]], [2], [3]), "negative"),
        (([[1.7]], [[1]], [2], [3]), "ints"),
        (([[True, 2]], [[1, 2]], [2], [3]), "ints"),
        (([[1, 2]], [[1, 2]], [2.5], [3]), "answer"),
        (([[1, 2]], [[1, 2]], ["x"], [3]), "answer"),
        (([[1, 2]], [[1, 2]], [None], [3]), "answer"),
        (([[1, 2]], [[1, 2]], [-1], [3]), "answer"),
        (([[1, 2]], [[1, 2]], [2], [[3, 1.5]]), "counterfactual"),
        (("ab", [[1, 2]], [2], [3]), "clean"),
        (([[1, 2]], [[1, 2]], 2, [3]), "answers"),
        (([[1, 2]], [["a", 2]], [2], [3]), "corrupted"),
    ],
)
def test_pairs_from_tokens_refuses_bad_ids(args, match):
    with pytest.raises(BAD, match=match):
        pairs_from_tokens(*args)


def test_pairs_from_tokens_refuses_bad_pad_id():
    with pytest.raises(HeadsteerValueError, match="pad_id"):
        pairs_from_tokens([[1, 2]], [[1, 2]], [2], [3], pad_id=-1)


_OUT_OF_VOCAB = [
    ("clean", lambda V: pairs_from_tokens([[1, V]], [[1, 3]], [2], [3])),
    ("corrupted", lambda V: pairs_from_tokens([[1, 3]], [[1, 10**6]], [2], [3])),
    ("answer", lambda V: pairs_from_tokens([[1, 3]], [[1, 4]], [V + 5], [3])),
    ("counterfactual", lambda V: pairs_from_tokens([[1, 3]], [[1, 4]], [2], [V])),
]


FNS = ["patch", "path_patch", "dla", "logit_lens", "head_logits", "logit_inspection"]


def _runners(model):
    return {
        "patch": lambda p: patch(model, p, "head_out", options=OPTS),
        "path_patch": lambda p: path_patch(model, p, options=OPTS),
        "dla": lambda p: direct_logit_attribution(model, p),
        "logit_lens": lambda p: logit_lens(model, p),
        "head_logits": lambda p: head_logits(model, p),
        "logit_inspection": lambda p: logit_inspection(model, p),
    }


@pytest.mark.parametrize("field, make", _OUT_OF_VOCAB, ids=[f for f, _ in _OUT_OF_VOCAB])
@pytest.mark.parametrize("fn", FNS)
def test_out_of_vocab_ids_refused_before_forward(model, no_forward, field, make, fn):
    with pytest.raises(HeadsteerValueError, match=f"{field} token id .* outside the vocabulary"):
        _runners(model)[fn](make(model.d_vocab))


def test_circuit_scores_refuse_out_of_vocab(tokenizer):
    from heads.scorers.circuits import edge_scores

    m = make_tiny("qwen2", tokenizer)
    with pytest.raises(HeadsteerValueError, match="outside the vocabulary"):
        edge_scores(m, pairs_from_tokens([[1, m.d_vocab]], [[1, 3]], [2], [3]), progress=False)


@pytest.mark.parametrize("fn", FNS)
def test_list_instead_of_pairbatch(model, no_forward, fn):
    with pytest.raises(HeadsteerTypeError, match="PairBatch"):
        _runners(model)[fn]([[1, 2, 3]])


@pytest.mark.parametrize("fn", ["dla", "logit_lens", "head_logits"])
def test_logit_scorers_check_length(model, no_forward, fn):
    if model.max_positions is None:
        pytest.skip("the tiny model has no context limit")
    n = model.max_positions + 1
    p = pairs_from_tokens([[1] * n], [[1] * n], [2], [3])
    with pytest.raises(HeadsteerValueError, match="exceeds the model's limit"):
        _runners(model)[fn](p)


@pytest.mark.parametrize("k", [0, 10**9, True, "5"])
def test_logit_lens_k_bounded_by_vocab(model, no_forward, k):
    with pytest.raises(HeadsteerValueError, match="k must be"):
        logit_lens(model, _ok(), k=k)
    with pytest.raises(HeadsteerValueError, match="k must be"):
        logit_inspection(model, _ok(), k=k)


@pytest.mark.parametrize("options", [5, {"max_rows": 4}, "fast"])
def test_options_must_be_sweep_options(model, no_forward, options):
    with pytest.raises(HeadsteerTypeError, match="options"):
        patch(model, _ok(), options=options)
    with pytest.raises(HeadsteerTypeError, match="options"):
        path_patch(model, _ok(), options=options)


@pytest.mark.parametrize("kind", ["head_out", "q", "k", "v", "pattern"])
def test_positions_refused_for_kinds_without_positions(model, no_forward, kind):
    with pytest.raises(HeadsteerValueError, match="positions"):
        patch(model, _ok(), kind, positions=[999], options=OPTS)


@pytest.mark.parametrize("inputs", ["k", "v", ["q", "k"]])
def test_path_patch_logits_refuses_inputs(model, no_forward, inputs):
    with pytest.raises(HeadsteerValueError, match="inputs"):
        path_patch(model, _ok(), receivers="logits", inputs=inputs, options=OPTS)


def test_which_is_checked(model, no_forward):
    for fn in (direct_logit_attribution, logit_lens, head_logits):
        with pytest.raises(HeadsteerValueError, match="which"):
            fn(model, _ok(), which="both")


# ------------------------------------------------------------------------------ result files
@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    res = patch(model, _ok(), "head_out_by_pos", positions=[-1], options=OPTS)
    path = res.save(tmp_path_factory.mktemp("r") / "r.json")
    return res, json.loads(open(path).read())


_DELETE = object()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("kind", _DELETE, "kind"),
        ("kind", "bogus", "kind"),
        ("direction", "bogus", "direction"),
        ("schema_version", 99, "schema_version"),
        ("schema_version", True, "schema_version"),
        ("shape", [7, 7], "shape"),
        ("shape", [3, 4, 1, 0], "shape"),
        ("shape", "abc", "shape"),
        ("raw", "abc", "raw"),
        ("raw", ["a"], "raw"),
        ("raw", [1.0], "raw"),
        ("grid", 5, "grid"),
        ("grid", ["layer", "position"], "grid"),
        ("clean", [1.0], "clean"),
        ("clean", [1.0, 2.0, 3.0], "clean"),
        ("corrupt", None, "corrupt"),
        ("labels", [1], "labels"),
        ("n_kv_heads", "x", "n_kv_heads"),
        ("params", [1], "params"),
        ("metric", 3, "metric"),
    ],
)
def test_load_refuses_tampered_fields(saved, tmp_path, field, value, match):
    _, d = saved
    d = json.loads(json.dumps(d))
    if value is _DELETE:
        del d[field]
    else:
        d[field] = value
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))
    with pytest.raises(HeadsteerValueError, match=match) as err:
        PatchResult.load(p)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x81\x00"])
def test_load_refuses_non_json(tmp_path, content):
    p = tmp_path / "x.json"
    p.write_bytes(content)
    with pytest.raises(HeadsteerValueError, match="JSON|UTF-8"):
        PatchResult.load(p)


def test_load_round_trip_and_reduce(saved, tmp_path):
    res, d = saved
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(d))
    back = PatchResult.load(p)
    assert torch.allclose(back.raw.nan_to_num(), res.raw.nan_to_num()) and back.grid == res.grid
    with pytest.raises(HeadsteerValueError, match="reduce"):
        res.head_scores(reduce="x")
    assert torch.allclose(res.head_scores("sum").scores.nan_to_num(), res.mean.nansum(-1))


# ------------------------------------------------------------------------------ HeadScores.from_cache
def test_from_cache_refuses_mismatched_hook_in_and_bad_model():
    from heads.results.scores import HeadScores

    pattern = torch.softmax(torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0)), -1)
    cache = {f"blocks.{la}.attn.hook_pattern": pattern for la in range(2)}
    tokens = torch.arange(10).reshape(2, 5)
    ok = HeadScores.from_cache({**cache, "embed.hook_in": tokens.clone()}, (1, 3), tokens=tokens)
    torch.testing.assert_close(ok.scores[0], pattern[:, :, -1, 1:3].sum(-1).mean(0))
    for ran in (torch.arange(12).reshape(2, 6), torch.arange(5).reshape(1, 5)):
        with pytest.raises(HeadsteerValueError, match="embed.hook_in"):
            HeadScores.from_cache({**cache, "embed.hook_in": ran}, (1, 3), tokens=tokens)
    with pytest.raises(HeadsteerTypeError, match="model"):
        HeadScores.from_cache(cache, (1, 3), model=5)  # type: ignore[arg-type]
    with pytest.raises(HeadsteerTypeError, match="n_kv_heads"):
        HeadScores.from_cache(cache, (1, 3), n_kv_heads="2")  # type: ignore[arg-type]


def test_by_position_patching_warns_when_a_column_holds_different_names(tiny_llama):
    """Pairs of one length whose templates interleave (IOI's ABBA / BABA: IO first in one pair,
    S1 first in the other) share their columns but not their roles; a by-position mean then mixes
    IO and S1 silently (newcomer). `patch` warns, naming the column and the names' counts, and the
    note goes to `params["labels_from"]`; aligned pairs get no warning."""
    import warnings

    from heads import SweepOptions
    from heads.scorers.patching import pairs_from_tokens
    from heads.scorers.patching.activation import patch

    clean = [[40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55]]
    corrupted = [[40, 41, 49, 43, 44, 45], [50, 51, 58, 53, 54, 55]]
    opts = SweepOptions(progress=False)
    swapped = pairs_from_tokens(
        clean, corrupted, [[20], [30]], [[21], [31]], positions={"IO": [2, 3], "S1": [3, 2]}
    )
    with pytest.warns(UserWarning, match=r"column 2 holds different named positions .*'IO' in 1, 'S1' in 1"):
        res = patch(tiny_llama, swapped, "resid_pre", layers=[0], positions=[2, 3], options=opts)
    assert "'IO' in 1" in res.params["labels_from"]
    aligned = pairs_from_tokens(
        clean, corrupted, [[20], [30]], [[21], [31]], positions={"IO": [2, 2], "S1": [3, 3]}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch(tiny_llama, aligned, "resid_pre", layers=[0], positions=[2, 3], options=opts)


def test_no_pairs_and_no_model_are_refused_by_name(tiny_llama, tokenizer):
    """An empty `PairBatch` (`pairs.select([])`) crashed inside the model's forward, and a model
    of None raised a bare AttributeError (breaker): both are refused by name before any forward."""
    from heads.errors import HeadsteerTypeError
    from heads.scorers.patching.activation import patch
    from heads.scorers.patching.pairs import encode_pairs
    from tests.support.patching import PAIRS

    pairs = encode_pairs(tokenizer, PAIRS)
    for kind in ("head_out", "resid_pre", "pattern"):
        with pytest.raises(HeadsteerValueError, match=r"holds no pairs \(n = 0"):
            patch(tiny_llama, pairs.select([]), kind)
    with pytest.raises(HeadsteerTypeError, match="model must be a HeadModel .*NoneType"):
        patch(None, pairs, "head_out")

"""Head-role detectors, Attention Lens and the head atlas (methods: docs/methods/head_roles.md)."""

from __future__ import annotations

import pytest
import torch

from heads import HeadsteerValueError, editing, forward
from heads.engine.edits import Recorder
from heads.inputs.prompts import EncodedPrompts
from heads.scorers.roles import (
    AttentionLens,
    collect_lens_data,
    copying_scores,
    detect_roles,
    head_atlas,
    pattern_scores,
    repeated_tokens,
    retrieval_scores,
    successor_scores,
    train_lens,
)
from tests.support import make_tiny
from tests.support.role_models import make_role_model


@pytest.fixture(scope="module")
def role_model():
    return make_role_model()


@pytest.fixture(scope="module")
def role_scores(role_model):
    return detect_roles(role_model, apply_first_mlp=False)


def _others_low(s: torch.Tensor, layer: int, head: int, low: float = 0.1) -> None:
    mask = torch.ones_like(s, dtype=torch.bool)
    mask[layer, head] = False
    assert s[mask].max() < low, s


def test_hand_built_heads_found(role_scores):
    """Heads built to be previous-token / self / induction / duplicate-token score ~1, others low."""
    want = {
        "previous_token": (0, 0),
        "self": (0, 1),
        "induction": (1, 0),
        "duplicate_token": (1, 1),
        "copying": (1, 0),
        "retrieval": (1, 0),
    }
    for name, (la, h) in want.items():
        s = role_scores.head_scores(name).scores
        assert s[la, h] > 0.99, (name, s)
        _others_low(s, la, h)
    ent = role_scores.head_scores("entropy").scores
    assert ent[0, 2] > 0.99 and ent[0, 3] > 0.99  # the uniform heads
    assert ent[0, 0] < 0.01 and ent[0, 1] < 0.01


def test_atlas_roles(role_model, role_scores):
    atlas = head_atlas(role_model, detectors=role_scores)
    assert len(atlas.frame) == 8
    roles = {(r.layer, r.head): r.role for r in atlas.frame.itertuples()}
    assert roles == {
        (0, 0): "previous_token",
        (0, 1): "self",
        (0, 2): "none",
        (0, 3): "none",
        (1, 0): "induction",
        (1, 1): "duplicate_token",
        (1, 2): "none",
        (1, 3): "none",
    }
    assert atlas.heads_with("induction") == [(1, 0)]
    assert atlas.thumbnails is not None and tuple(atlas.thumbnails.shape) == (2, 4, 24, 24)
    assert set(atlas.roles_by_layer().columns) >= {"induction", "none"}
    with pytest.raises(HeadsteerValueError, match="given twice"):
        head_atlas(
            role_model,
            detectors=role_scores,
            scores={"induction": role_scores.head_scores("induction")},
            thumbnails=False,
        )


def test_atlas_save_load(role_model, role_scores, tmp_path):
    atlas = head_atlas(
        role_model, detectors=role_scores, scores={"extra": role_scores.head_scores("self")}, thumbnails=False
    )
    path = atlas.save(tmp_path / "atlas.json")
    back = type(atlas).load(path)
    assert back.frame["role"].tolist() == atlas.frame["role"].tolist()
    assert back.frame["extra"].tolist() == pytest.approx(atlas.frame["extra"].tolist())


def _rows_alone(enc: EncodedPrompts) -> list[torch.Tensor]:
    return [enc.input_ids[b][enc.attention_mask[b].bool()][None] for b in range(enc.batch)]


def test_padding_and_eager_equal(tokenizer):
    model = make_tiny("llama", tokenizer, attn="sdpa", seed=3)
    eager = make_tiny("llama", tokenizer, attn="eager", seed=3)
    enc = repeated_tokens(model, n_seqs=3, length=(5, 12), seed=1)
    assert (enc.attention_mask == 0).any()  # the batch is padded
    batch = pattern_scores(model, enc)
    alone = [pattern_scores(model, r) for r in _rows_alone(enc)]
    other = pattern_scores(eager, enc)
    for name, s in batch.items():
        mean = torch.stack([a[name].scores for a in alone]).mean(0)
        torch.testing.assert_close(s.scores, mean, atol=1e-5, rtol=0)
        torch.testing.assert_close(s.scores, other[name].scores, atol=1e-5, rtol=0)
    e1 = repeated_tokens(model, n_seqs=2, length=(4, 6), seed=7)
    e2 = repeated_tokens(model, n_seqs=2, length=(4, 6), seed=7)
    assert torch.equal(e1.input_ids, e2.input_ids)  # deterministic for a seed


def test_transformer_lens_formula_oracle(tokenizer):
    """rows='all' equals TransformerLens' detect_head 'mul' score, computed by its own functions."""
    hd = pytest.importorskip("transformer_lens.head_detector")
    model = make_tiny("llama", tokenizer, seed=5)
    enc = repeated_tokens(model, n_seqs=2, length=(6, 9), seed=2)
    for opts in ({}, {"exclude_bos": True, "exclude_current_token": True}):
        ours = pattern_scores(
            model, enc, rows="all", detectors=("previous_token", "duplicate_token", "induction"), **opts
        )
        want = {n: torch.zeros(model.n_layers, model.n_heads) for n in ours}
        for row in _rows_alone(enc):
            recs = [Recorder(layer=la) for la in range(model.n_layers)]
            with editing(model, recs):
                forward(model, EncodedPrompts(row, torch.ones_like(row), [[]], [""], [[]]))
            for n in ours:
                det = getattr(hd, f"get_{n}_head_detection_pattern")(row)
                for la, rec in enumerate(recs):
                    pat = torch.cat(rec.records, dim=2)[0]
                    for h in range(model.n_heads):
                        want[n][la, h] += (
                            hd.compute_head_attention_similarity_score(
                                pat[h],
                                det,
                                exclude_bos=bool(opts),
                                exclude_current_token=bool(opts),
                                error_measure="mul",
                            )
                            / enc.batch
                        )
        for n in ours:
            torch.testing.assert_close(ours[n].scores, want[n], atol=1e-5, rtol=0)


def test_successor_and_copying_on_constructed_ov(tokenizer):
    """A head whose OV maps each day to the next scores 1 on 'days' and a copying head 0 there."""
    model = make_tiny("llama", tokenizer, seed=1)
    days = [" Monday", " Tuesday", " Wednesday", " Thursday", " Friday"]
    ids = [tokenizer(d, add_special_tokens=False)["input_ids"][0] for d in days]
    base = successor_scores(model, {"days": days}, apply_first_mlp=False)
    assert base.scores.shape == (3, 4) and 0 <= base.scores.min() and base.scores.max() <= 1
    with torch.no_grad():  # layer 0 head 0: W_U^T-side map token i -> token i+1 through E and U
        attn = model.attentions[0]
        d = model.d_head
        E, U = model.W_E, model.W_U  # [V, D], [D, V]
        src = E[ids[:-1]]  # [4, D]
        tgt = U[:, ids[1:]].T  # [4, D]
        v = torch.linalg.pinv(src) @ torch.eye(4)[:, :4].repeat(1, 1)  # [D, 4]: e_i -> unit i
        v_full = torch.zeros(model.d_model, d)
        v_full[:, :4] = v
        o_full = torch.zeros(d, model.d_model)
        o_full[:4] = tgt * 50.0
        attn.v_proj.weight[:d] = v_full.T
        attn.o_proj.weight[:, :d] = o_full.T
    s = successor_scores(model, {"days": days}, apply_first_mlp=False)
    assert s.scores[0, 0] == 1.0
    with pytest.raises(HeadsteerValueError, match="no ordinal"):
        successor_scores(model, {"x": [" Monday", " zzqqxx"]})
    c = copying_scores(model, n_tokens=64, apply_first_mlp=False)
    assert c.scores.shape == (3, 4)


def test_bad_input(role_model):
    with pytest.raises(HeadsteerValueError, match="unknown detector"):
        pattern_scores(role_model, detectors=("bogus",))
    with pytest.raises(HeadsteerValueError, match="rows"):
        pattern_scores(role_model, rows="some")
    with pytest.raises(HeadsteerValueError, match="length"):
        repeated_tokens(role_model, length=(10, 5))
    with pytest.raises(HeadsteerValueError, match="n_prompts"):
        retrieval_scores(role_model, n_prompts=0)
    with pytest.raises(HeadsteerValueError, match="vocabulary"):
        pattern_scores(role_model, torch.tensor([[0, 999]]))


@pytest.fixture(scope="module")
def lens_setup(tokenizer):
    from probes.datasets.corpus import load_corpus

    model = make_tiny("llama", tokenizer, seed=0)
    data = collect_lens_data(model, load_corpus(24), [(0, 0), (1, 2), (2, 3)], max_positions=240)
    return model, data


def test_lens_lowers_held_out_kl(lens_setup):
    model, data = lens_setup
    lens = train_lens(model, data, [(0, 0), (1, 2), (2, 3)], epochs=3, lr=3e-3, progress=False)
    assert lens.held_out_kl is not None and lens.untrained_kl is not None
    assert (lens.held_out_kl < lens.untrained_kl).all()
    ratio = lens.kl_scores("ratio").scores
    assert ratio[0, 0] < 1 and torch.isnan(ratio[0, 1])
    assert len(lens.history) == 3


def test_lens_save_load_bitwise_and_refused(lens_setup, tokenizer, tmp_path):
    model, data = lens_setup
    lens = train_lens(model, data, [(1, 2)], epochs=1, progress=False)
    path = lens.save(tmp_path / "lens.safetensors")
    back = AttentionLens.load(path, model)
    o = data.outputs[[data.heads.index((1, 2))], :16]
    assert torch.equal(back.logits(model, o), lens.logits(model, o))
    with pytest.raises(HeadsteerValueError, match="exists"):
        lens.save(path)
    other = make_tiny("qwen2", tokenizer)
    with pytest.raises(HeadsteerValueError, match="made for"):
        AttentionLens.load(path, other)
    df = back.top_tokens(model, "Anna met Ben at the market.", 1, 2, k=2)
    assert list(df.columns) == ["position", "token", "lens_tokens", "untrained_tokens", "model_tokens"]


def test_lens_resume_equals_uninterrupted(lens_setup, tmp_path):
    model, data = lens_setup
    heads = [(0, 0)]
    straight = train_lens(model, data, heads, epochs=2, patience=5, progress=False)
    ck = tmp_path / "ck.safetensors"
    train_lens(model, data, heads, epochs=1, patience=5, progress=False, checkpoint=ck)
    resumed = train_lens(model, data, heads, epochs=2, patience=5, progress=False, checkpoint=ck)
    torch.testing.assert_close(resumed.weight, straight.weight, atol=1e-6, rtol=0)
    assert len(resumed.history) == 2


def test_lens_bad_input(lens_setup):
    model, data = lens_setup
    with pytest.raises(HeadsteerValueError, match="form"):
        train_lens(model, data, [(0, 0)], form="wide")
    with pytest.raises(HeadsteerValueError, match="full"):
        AttentionLens.init(model, None, form="full")
    with pytest.raises(HeadsteerValueError, match="lacks heads"):
        train_lens(model, data, [(2, 0)])


def test_atlas_sink_columns_say_which_is_which(tiny_llama, tmp_path):
    """Sink statistics give two columns, `first_token_mass` and `sink_mass`; the `sink` role reads
    the first one (issue 40, item 5). Old atlas files named the first-token column `sink`."""
    import json

    from heads.results.scores import HeadScores
    from heads.scorers.roles.atlas import HeadAtlas
    from heads.scorers.sinks import sink_stats

    stats = sink_stats(tiny_llama, ["the cat sat on the mat today", "one two three four five"], chat=False)
    first, mass = stats.first_mass.scores, stats.sink_mass.scores
    t = float(first.flatten().median())
    zero = HeadScores(torch.zeros_like(first), "x", model=tiny_llama.name)
    atlas = head_atlas(
        tiny_llama, detectors={"induction": zero}, sinks=stats, thresholds={"sink": t}, thumbnails=False
    )
    f = atlas.frame
    assert "sink" not in f.columns and {"first_token_mass", "sink_mass", "n_sinks"} <= set(f.columns)
    assert torch.equal(torch.tensor(f["first_token_mass"].to_numpy()), first.flatten())
    assert torch.equal(torch.tensor(f["sink_mass"].to_numpy()), mass.flatten())
    # the oracle: a head is a sink exactly when its first-token mass reaches the threshold
    assert f["role"].tolist() == ["sink" if v >= t else "none" for v in first.flatten().tolist()]
    got = atlas.heads_with("sink")
    assert [float(first[la, h]) for la, h in got] == sorted(
        (float(v) for v in first.flatten() if v >= t), reverse=True
    )
    # an atlas file of an earlier version (first-token column `sink`) loads with the new name
    data = json.loads(atlas.save(tmp_path / "a.json").read_text())
    for r in data["rows"]:
        r["sink"] = r.pop("first_token_mass")
    data["sources"]["sink"] = data["sources"].pop("first_token_mass")
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = HeadAtlas.load(tmp_path / "old.json")
    assert "sink" not in old.frame.columns and old.frame["role"].tolist() == f["role"].tolist()
    assert old.frame["first_token_mass"].tolist() == pytest.approx(f["first_token_mass"].tolist())
    assert old.relabel({"sink": t}).frame["role"].tolist() == f["role"].tolist()

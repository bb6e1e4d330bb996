"""MAPS (the rules of docs/methods/maps.md) on tiny random models."""

import copy
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from heads import HeadModel, HeadScale, editing, encode_prompts, forward
from heads.scorers.maps.inference import dynamic_scores, max_ablated_heads, pearson, relation_accuracy
from heads.scorers.maps.static import (
    RelationPairs,
    k_for,
    maps_scores,
    salient_operations,
    source_representations,
    target_ranks,
)
from probes.datasets.relations import load_relations, relation_names, single_token_pairs
from tests.support import make_tiny


def small_vocab(tokenizer, **kw) -> HeadModel:
    hm = make_tiny("llama", tokenizer, vocab_size=128, **kw)
    hm.tokenizer = None
    return hm


def random_relations(seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    rels = []
    for i, k in enumerate((1, 10, 3)):
        src = torch.randperm(vocab, generator=g)[:20].tolist()
        tgt = torch.randint(0, vocab, (20,), generator=g).tolist()
        rels.append(RelationPairs(f"r{i}", list(zip(src, tgt, strict=True)), k))
    return rels


def dense_scores(hm: HeadModel, rel: RelationPairs, *, sign=1.0, apply_first_mlp=True):
    """Explicit |V| x |V| M per head (tiny vocab only) and top-k with ties to the lowest id."""
    out = torch.zeros(hm.n_layers, hm.n_heads)
    ids = torch.arange(hm.d_vocab)
    for layer in range(hm.n_layers):
        e = source_representations(hm, ids, layer, apply_first_mlp=apply_first_mlp)
        for h in range(hm.n_heads):
            m = sign * (e @ hm.W_V[layer, hm.kv_head(h)] @ hm.W_O[layer, h] @ hm.W_U)
            hit = 0
            for s, t in rel.pairs:
                order = sorted(range(hm.d_vocab), key=lambda j, row=m[s]: (-row[j].item(), j))
                hit += t in order[: rel.k]
            out[layer, h] = hit / len(rel.pairs)
    return out


def test_chunked_scores_equal_dense_product(tokenizer):
    hm = small_vocab(tokenizer)
    rels = random_relations()
    ms = maps_scores(hm, rels, pair_chunk=7)
    for r in rels:
        torch.testing.assert_close(ms.relation[r.name].scores, dense_scores(hm, r), atol=1e-6, rtol=0)
        torch.testing.assert_close(
            ms.suppression[r.name].scores, dense_scores(hm, r, sign=-1.0), atol=1e-6, rtol=0
        )
    assert ms.relation["r0"].scores.shape == (3, 4)


def test_best_relation_is_the_per_head_maximum_and_the_atlas_columns(tokenizer):
    """`MapsScores.best_relation`: per head the highest relation score (ties to the first
    relation) and its name; NaN counts as -1; the atlas' best_relation columns are the same."""
    from heads.scorers.roles.atlas import head_atlas

    hm = small_vocab(tokenizer)
    ms = maps_scores(hm, random_relations(), progress=False)
    ms.relation["r1"].scores[0, 0] = float("nan")
    best, which = ms.best_relation()
    assert best.method == "maps_best_relation" and best.params["relations"] == ["r0", "r1", "r2"]
    for la in range(hm.n_layers):
        for h in range(hm.n_heads):
            vals = [ms.relation[n].scores[la, h].item() for n in ms.names()]
            vals = [-1.0 if v != v else v for v in vals]
            i = vals.index(max(vals))  # the first of equal maxima
            assert best.scores[la, h].item() == vals[i] and which[la][h] == ms.names()[i]
    assert len({n for row in which for n in row}) > 1  # not one relation everywhere
    frame = head_atlas(hm, detectors={}, maps=ms, thumbnails=False).frame
    assert list(frame["best_relation"]) == [n for row in which for n in row]
    assert frame["best_relation_score"].tolist() == best.scores.flatten().tolist()


def test_suppression_equals_scoring_negated_model(tokenizer):
    hm = small_vocab(tokenizer)
    neg = HeadModel(copy.deepcopy(hm.model), None)
    with torch.no_grad():
        for o in neg.out_projs:
            o.weight.neg_()
    rels = random_relations(1)
    a, b = maps_scores(hm, rels), maps_scores(neg, rels)
    for r in rels:
        assert torch.equal(a.suppression[r.name].scores, b.relation[r.name].scores)


def test_gqa_heads_read_their_groups_w_v(tokenizer):
    hm = small_vocab(tokenizer)
    rels = random_relations(2)
    before = maps_scores(hm, rels)
    other = HeadModel(copy.deepcopy(hm.model), None)
    with torch.no_grad():  # change only KV head 1 of layer 1 (query heads 2, 3)
        other.attentions[1].v_proj.weight[16:32] = torch.randn(16, 64)
    after = maps_scores(other, rels)
    for r in rels:
        s0, s1 = before.relation[r.name].scores, after.relation[r.name].scores
        assert torch.equal(s0[1, :2], s1[1, :2]) and torch.equal(s0[[0, 2]], s1[[0, 2]])
    assert any(
        not torch.equal(before.relation[r.name].scores[1, 2:], after.relation[r.name].scores[1, 2:])
        for r in rels
    )
    assert torch.equal(hm.W_V[1, hm.kv_head(0)], hm.W_V[1, hm.kv_head(1)])


def test_planted_copying_head(tokenizer):
    """Layer-0 head with W_V = Bs, W_O = Bs^T over tied, row-normalised embeddings in span(Bs)."""
    hm = small_vocab(tokenizer, tie_word_embeddings=True)
    torch.manual_seed(3)
    d, dh, v = 64, 16, 128
    bs, _ = torch.linalg.qr(torch.randn(d, dh))  # orthonormal basis [D, d_h]
    r = torch.nn.functional.normalize(torch.randn(v, dh), dim=1)
    with torch.no_grad():
        hm.model.model.embed_tokens.weight.copy_(r @ bs.T)
        att = hm.attentions[0]
        att.v_proj.weight[:dh] = bs.T  # KV head 0 -> W_V = Bs
        att.o_proj.weight[:, :dh] = bs  # query head 0 -> W_O = Bs^T
    assert (
        hm.model.get_output_embeddings().weight.data_ptr()
        == hm.model.get_input_embeddings().weight.data_ptr()
    )
    copying = RelationPairs("copy", [(t, t) for t in range(v)], 1)
    ms = maps_scores(hm, [copying])
    assert ms.relation["copy"].scores[0, 0] == 1.0
    with torch.no_grad():
        att.o_proj.weight[:, :dh] = -bs
    ms = maps_scores(hm, [copying])
    assert ms.suppression["copy"].scores[0, 0] == 1.0 and ms.relation["copy"].scores[0, 0] == 0.0


def test_positive_row_scaling_of_sources_is_irrelevant(tokenizer):
    hm = small_vocab(tokenizer)
    rels = random_relations(4)
    a = maps_scores(hm, rels, apply_first_mlp=False)
    scaled = HeadModel(copy.deepcopy(hm.model), None)
    w = scaled.model.model.embed_tokens.weight
    assert w.data_ptr() != scaled.model.lm_head.weight.data_ptr()  # untied: U stays as it was
    with torch.no_grad():
        w.mul_(torch.rand(w.shape[0], 1) * 5 + 0.1)
    b = maps_scores(scaled, rels, apply_first_mlp=False)
    for r in rels:
        assert torch.equal(a.relation[r.name].scores, b.relation[r.name].scores)


def test_target_ranks_ties_go_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    rank, neg = target_ranks(logits, torch.tensor([2, 3]))
    assert rank.tolist() == [1, 3] and neg.tolist() == [3, 3]  # -row: [-1,-3,-3,0] puts id 2 last


def test_k_rule():
    assert (k_for("copy", 49152), k_for("default", 49152)) == (1, 10)
    assert (k_for("copy", 128256), k_for("default", 128256)) == (3, 25)
    with pytest.raises(ValueError, match="k_rule"):
        k_for("other", 10)
    assert max_ablated_heads(270) == 30 and max_ablated_heads(1024) == 150


def test_single_token_filter_and_relation_names(tokenizer):
    kept = single_token_pairs(tokenizer, [["Paris", "France"], ["chien", "dog"], ["1990", "1991"]])
    assert [(a, b) for a, b, _, _ in kept] == [("Paris", "France")]
    assert kept[0][2] == tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    rs = load_relations(tokenizer)
    assert "next_year" in rs.dropped and "0 of" in rs.dropped["next_year"]
    assert len(rs.relations) >= 10 and all(len(r.pairs) >= 30 for r in rs.relations)
    kinds = {rs.kinds[r.name] for r in rs.relations}
    assert kinds == {"algorithmic", "knowledge", "linguistic", "translation"}
    assert {r.name: r.k for r in rs.relations}["copying"] == 1
    with pytest.raises(ValueError, match="unknown relation.*'capitals'"):
        load_relations(tokenizer, "capitals,plural")
    with pytest.raises(ValueError, match="no relation has enough"):
        load_relations(tokenizer, ["next_year"])
    assert "country_capital" in relation_names()


def test_bad_relations_raise(tokenizer):
    hm = small_vocab(tokenizer)
    with pytest.raises(ValueError, match="no relations"):
        maps_scores(hm, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        maps_scores(hm, [RelationPairs("x", [(0, 500)], 1)])
    with pytest.raises(ValueError, match="no pairs"):
        RelationPairs("x", [], 1)
    with pytest.raises(TypeError):
        maps_scores(hm, [("x", [(0, 1)])])


def test_salient_operations_sigma(tokenizer):
    hm = small_vocab(tokenizer)
    df = salient_operations(hm, 1, 2, k_s=6, k_m=3)
    assert len(df) == 6 and all(len(t) == 3 for t in df["target_ids"])
    ids = torch.tensor(df["source_id"].tolist())
    e = source_representations(hm, ids, 1)
    direct = (e @ hm.W_V[1, hm.kv_head(2)] @ hm.W_O[1, 2]).norm(dim=1) / e.norm(dim=1)
    torch.testing.assert_close(torch.tensor(df["sigma"].tolist()), direct, atol=1e-5, rtol=1e-5)
    assert list(df["sigma"]) == sorted(df["sigma"], reverse=True)


def test_salient_operations_with_shared_sources_are_the_same(tokenizer):
    """`vocabulary_sources` computed once and passed to every head gives each head's own result."""
    from heads.scorers.maps.static import vocabulary_sources

    hm = small_vocab(tokenizer)
    shared = vocabulary_sources(hm, 1, chunk=7)
    assert torch.equal(shared, vocabulary_sources(hm, 2, chunk=7))  # the same for every layer above 0
    torch.testing.assert_close(shared, source_representations(hm, torch.arange(hm.d_vocab), 1))
    for layer, head in ((1, 2), (2, 0)):
        want = salient_operations(hm, layer, head, k_s=6, k_m=3)
        got = salient_operations(hm, layer, head, k_s=6, k_m=3, sources=shared)
        assert list(got["source_id"]) == list(want["source_id"])
        assert list(got["target_ids"]) == list(want["target_ids"])
        torch.testing.assert_close(torch.tensor(got["sigma"]), torch.tensor(want["sigma"]))
    with pytest.raises(ValueError, match=r"sources must be \[d_vocab, d_model\]"):
        salient_operations(hm, 1, 2, sources=shared[:-1])


def test_dynamic_scores_match_hooked_recomputation(tiny_llama, tokenizer):
    rs = load_relations(tokenizer, "plural")
    rel = rs["plural"]
    dyn = dynamic_scores(tiny_llama, rel, templates=["The story of {x} contains"], max_pairs=5)["plural"]
    prompts = [f"The story of {s} contains" for s, _ in rel.texts[:5]]
    enc = encode_prompts(tokenizer, prompts, chat=False, markup=False)
    grabbed = {}
    hooks = [
        o.register_forward_pre_hook(lambda m, a, i=i: grabbed.__setitem__(i, a[0][:, -1].clone()))
        for i, o in enumerate(tiny_llama.out_projs)
    ]
    try:
        forward(tiny_llama, enc)
    finally:
        for h in hooks:
            h.remove()
    want = torch.zeros(tiny_llama.n_layers, tiny_llama.n_heads)
    tg = [t for _, t in rel.pairs[:5]]
    for layer in range(tiny_llama.n_layers):
        z = grabbed[layer].view(5, tiny_llama.n_heads, tiny_llama.d_head)
        for h in range(tiny_llama.n_heads):
            logits = z[:, h] @ tiny_llama.W_O[layer, h] @ tiny_llama.W_U
            rank, _ = target_ranks(logits, torch.tensor(tg))
            want[layer, h] = (rank < rel.k).float().mean()
    torch.testing.assert_close(dyn[0], want)


def test_pearson():
    a, b = torch.rand(50), torch.rand(50)
    assert abs(pearson(a, b) - np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 1e-9
    assert np.isnan(pearson(torch.ones(5), torch.rand(5)))


def test_last_position_ablation(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, ["a b c d e", "f g h"], chat=False)
    base = forward(tiny_llama, enc)
    with editing(tiny_llama, HeadScale(layer=1, heads=[0, 2], factor=0.0, positions=[-1])):
        abl = forward(tiny_llama, enc)
    assert torch.equal(abl[:, :-1], base[:, :-1]) and not torch.equal(abl[:, -1], base[:, -1])
    rel = load_relations(tokenizer, "plural")["plural"]
    assert relation_accuracy(tiny_llama, rel, (), n_prompts=6) == relation_accuracy(
        tiny_llama, rel, n_prompts=6
    )


def test_report_maps_cli(tiny_llama_dir, tmp_path):
    from viz.cli.main import app

    d = tiny_llama_dir
    out = tmp_path / "maps.html"
    r = CliRunner().invoke(
        app,
        [
            "report",
            "maps",
            "--model",
            str(d),
            "--relations",
            "plural,antonym",
            "--top",
            "3",
            "--draws",
            "2",
            "--prompts",
            "4",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["relations"] == ["plural", "antonym"]
    assert set(summary["ablation"]["plural"]) == {"n_heads", "base", "ablated", "random_mean", "skipped"}
    html = out.read_text()
    assert "Plotly.newPlot" in html and "Salient operations" in html and "pearson_r_static_vs_dynamic" in html
    bad = CliRunner().invoke(app, ["report", "maps", "--relations", "plurals", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown relation" in bad.output


def test_top_k_hits_equal_exact_ranks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (64, 40), generator=g).float()  # many ties
    tg = torch.randint(0, 40, (64,), generator=g)
    k = torch.randint(1, 11, (64,), generator=g)
    from heads.scorers.maps.static import top_k_hits

    hit, supp = top_k_hits(logits, tg, k)
    rank, neg = target_ranks(logits, tg)
    assert torch.equal(hit, rank < k) and torch.equal(supp, neg < k)


def test_ablation_uses_the_highest_scoring_heads(tiny_llama, tokenizer):
    from heads import HeadScores
    from heads.scorers.maps.inference import ablation_check

    rel = load_relations(tokenizer, "plural")["plural"]
    s = torch.zeros(3, 4)
    s[2, 3], s[2, 1], s[0, 0], s[1, 2] = 0.9, 0.8, 0.1, 0.05
    res = ablation_check(
        tiny_llama, rel, HeadScores(s, "x", n_kv_heads=2), n_heads=2, draws=2, n_prompts=4, min_base=0.0
    )
    assert res.heads == [(2, 3), (2, 1)] and res.n_heads == 2 and len(res.random) == 2
    assert HeadScores(s, "x").ranked(3) == [(2, 3), (2, 1), (0, 0)]
    for bad in (7, 2**63):  # more than half the 12 heads was cut to 6 silently: refused, by value
        with pytest.raises(ValueError, match=f"n_heads must be an int in 1..6 .*got {bad}"):
            ablation_check(tiny_llama, rel, HeadScores(s, "x", n_kv_heads=2), n_heads=bad)


def test_more_bad_input(tokenizer, tiny_llama):
    hm = small_vocab(tokenizer)
    rels = random_relations()
    with pytest.raises(ValueError, match="2 texts for 3 pairs"):
        RelationPairs("x", [(1, 2), (3, 4), (5, 6)], 1, texts=[("a", "b"), ("c", "d")])
    with pytest.raises(ValueError, match="appears twice"):
        maps_scores(hm, [rels[0], rels[0]])
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        maps_scores(hm, [RelationPairs("x", [(1, 2)], 500)])
    with pytest.raises(ValueError, match="pair_chunk"):
        maps_scores(hm, rels, pair_chunk=-1)
    with pytest.raises(TypeError, match="apply_first_mlp"):
        maps_scores(hm, rels, apply_first_mlp="no")
    with pytest.raises(ValueError, match="k_s"):
        salient_operations(hm, 0, 0, k_s=0)
    assert torch.equal(
        maps_scores(hm, rels[0]).relation["r0"].scores, maps_scores(hm, [rels[0]]).relation["r0"].scores
    )
    ms = maps_scores(hm, rels)
    with pytest.raises(ValueError, match="unknown layer"):
        ms.describe(-1, 0)
    rel = load_relations(tokenizer, "plural")["plural"]
    with pytest.raises(ValueError, match="templates"):
        dynamic_scores(tiny_llama, rel, templates=["no placeholder"])
    with pytest.raises(ValueError, match="n_prompts"):
        relation_accuracy(tiny_llama, rel, n_prompts=0)
    assert [r.name for r in load_relations(tokenizer, "plural, plural,").relations] == ["plural"]
    for bad in (0, -3, 2.5):  # 0 and -3 acted as 1 silently
        with pytest.raises(ValueError, match=f"min_pairs must be a positive int, got {bad}"):
            load_relations(tokenizer, "plural", min_pairs=bad)
        with pytest.raises(ValueError, match=f"d_vocab must be a positive int, got {bad}"):
            load_relations(tokenizer, "plural", d_vocab=bad)


def test_first_mlp_refuses_unknown_architectures(tokenizer):
    hm = small_vocab(tokenizer)
    hm.model.config.model_type = "olmo2"  # a post-norm family: its MLP input norm differs
    with pytest.raises(ValueError, match="apply_first_mlp=False"):
        maps_scores(hm, random_relations())
    assert maps_scores(hm, random_relations(), apply_first_mlp=False).names() == ["r0", "r1", "r2"]


def test_prompt_counts_beyond_a_relations_pairs_are_refused_before_any_forward(
    tiny_llama, tokenizer, monkeypatch
):
    """`n_prompts` / `n_shots` beyond the relation's pairs were cut silently (2**63 prompts ran
    its M pairs): refused, naming the value, before any forward. Default None: 40 prompts, or
    one per pair of a smaller relation (`AblationResult.n_prompts` says how many)."""
    import heads.scorers.maps.inference as inference
    from heads import HeadScores
    from heads.scorers.maps.analysis import maps_analysis

    rel = load_relations(tokenizer, "plural")["plural"]
    m = len(rel.pairs)
    assert rel.texts is not None and m > 5
    few = RelationPairs("few", rel.pairs[:5], rel.k, rel.texts[:5])
    assert relation_accuracy(tiny_llama, few) == relation_accuracy(tiny_llama, few, n_prompts=5)
    scores = HeadScores(torch.rand(3, 4), "x", n_kv_heads=2)
    res = inference.ablation_check(tiny_llama, few, scores, n_heads=1, draws=1, min_base=0.0)
    assert res.n_prompts == 5 and inference.ACCURACY_PROMPTS == 40

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the check")

    monkeypatch.setattr(inference, "forward", no_forward)
    for bad in (m + 1, 2**63):
        with pytest.raises(ValueError, match=rf"n_prompts must be an int in 1\.\.{m} .*got {bad}"):
            relation_accuracy(tiny_llama, rel, n_prompts=bad)
        with pytest.raises(ValueError, match=rf"n_prompts must be an int in 1\.\.{m} .*got {bad}"):
            inference.ablation_check(tiny_llama, rel, scores, n_prompts=bad)
    with pytest.raises(ValueError, match=r"n_shots must be an int in 0\.\.4 .*got 5"):
        relation_accuracy(tiny_llama, few, n_shots=5)  # 3-shot prompts need 4 other pairs
    three = RelationPairs("three", rel.pairs[:3], rel.k, rel.texts[:3])
    with pytest.raises(ValueError, match=r"n_shots must be an int in 0\.\.2 .*got 3"):
        maps_analysis(tiny_llama, [three], draws=1)


def test_draws_beyond_max_draws_are_refused_before_any_forward(tiny_llama, tokenizer, monkeypatch):
    """`ablation_check(draws=2**40)` ran the base and top-head passes, then built 2**40 random
    draws as a list until memory ran out: refused by value (`MAX_DRAWS`) before any forward, as
    are `maps_analysis`, `random_head_draws` and the safety study's `random_draws`."""
    import heads.scorers.maps.inference as inference
    from heads import HeadScores
    from heads.scorers.controls import MAX_DRAWS, random_head_draws
    from heads.scorers.maps.analysis import maps_analysis

    rel = load_relations(tokenizer, "plural")["plural"]
    scores = HeadScores(torch.rand(3, 4), "x", n_kv_heads=2)

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the check")

    monkeypatch.setattr(inference, "forward", no_forward)
    for bad in (MAX_DRAWS + 1, 2**40, 2**63):
        with pytest.raises(ValueError, match=rf"draws must be an int in 1\.\.{MAX_DRAWS}.*got {bad}"):
            inference.ablation_check(tiny_llama, rel, scores, n_heads=1, draws=bad, min_base=0.0)
        with pytest.raises(ValueError, match=rf"draws must be an int in 1\.\.{MAX_DRAWS}.*got {bad}"):
            maps_analysis(tiny_llama, [rel], draws=bad)
        with pytest.raises(ValueError, match=rf"draws must be an int in 0\.\.{MAX_DRAWS}.*got {bad}"):
            random_head_draws([(0, 0), (0, 1)], 1, bad, 0)
    assert len(random_head_draws([(0, 0), (0, 1)], 1, MAX_DRAWS, 0)) == MAX_DRAWS

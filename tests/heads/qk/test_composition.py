"""Composition scores: against TransformerLens' bridge (`all_composition_scores`, tiny Llama with
GQA), against explicit `d_model x d_model` matrices measured through each family's own modules
(norm gains, centring, QK-norm, post-norm folded), on a hand-built model whose layer-0 head
writes into a layer-1 head's key subspace, and the data-dependent version against
`qk_attribution`."""

from __future__ import annotations

import math
from contextlib import ExitStack

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from heads import HeadModel
from heads.results.composition import CompositionScores
from heads.scorers.qk import composition_scores, data_composition_scores, qk_attribution
from heads.scorers.qk.composition import baseline
from tests.support import make_tiny
from tests.support.families import tiny_family_model
from tests.support.qk_oracle import NAME, STATE, Stop, frozen, switch


def test_matches_transformer_lens_bridge(tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    hm = make_tiny("llama", tokenizer)  # 3 layers, 4 query heads, 2 KV heads
    bridge = TransformerBridge.boot_transformers(
        "tiny", hf_model=make_tiny("llama", tokenizer).model, tokenizer=tokenizer
    )
    cs = composition_scores(hm)
    for kind in "QKV":
        tl = bridge.all_composition_scores(kind)
        tl = torch.as_tensor(getattr(tl, "scores", tl)).float()
        mine = cs.raw[kind.lower()]
        valid = ~torch.isnan(mine)
        # TransformerLens zeroes the pairs whose writer is not in an earlier layer; we give NaN
        assert valid.sum() == 3 * 4 * 4  # (0->1, 0->2, 1->2) x 4 writers x 4 readers
        assert torch.all(tl[~valid] == 0)
        assert (tl[valid] - mine[valid]).abs().max() < 1e-5, kind


def _randomise_norms(hm: HeadModel, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, mod in hm.model.named_modules():
            if "norm" in type(mod).__name__.lower() or "ln" in name.split(".")[-1]:
                w = getattr(mod, "weight", None)
                if w is not None:
                    w.copy_(w + 0.5 * (torch.rand(w.shape, generator=g) - 0.5))
                b = getattr(mod, "bias", None)
                if b is not None:
                    b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _effective(hm: HeadModel, layer: int) -> dict[str, torch.Tensor]:
    """The layer's linear maps measured through its own modules, each norm's scale frozen at 1,
    at position 0 (no rotation): Q [H, D, d], K / V [G, D, d], O [H, d, D]."""
    D, H, d = hm.d_model, hm.n_heads, hm.d_head
    block = hm.layers[layer]
    attn = hm.attentions[layer]
    rows = torch.cat([torch.eye(D), torch.zeros(1, D)])[:, None, :]  # [D + 1, 1, D]
    one = torch.ones(1)
    with ExitStack() as st, torch.no_grad():
        st.callback(switch(hm, NAME))
        for mod in (getattr(block, "input_layernorm", None), getattr(block, "ln_1", None)):
            if mod is not None:
                mod.forward = frozen(mod, one)
                st.callback(mod.__dict__.pop, "forward")
        for nm in ("q_norm", "k_norm"):
            mod = getattr(attn, nm, None)
            if mod is not None:
                mod.forward = frozen(mod, one)
                st.callback(mod.__dict__.pop, "forward")

        def replace(mod, args, kwargs):
            if args:
                return (rows, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": rows}

        st.callback(block.register_forward_pre_hook(replace, with_kwargs=True).remove)
        STATE.update(layer=layer, stop=True)
        n = rows.shape[0]
        with pytest.raises(Stop):
            hm.model(
                input_ids=torch.zeros(n, 1, dtype=torch.long),
                position_ids=torch.zeros(n, 1, dtype=torch.long),
            )
    out = {}
    for key in ("q", "k", "v"):
        t = STATE[key][:, :, 0].float()  # [D + 1, X, d]
        out[key.upper()] = (t[:-1] - t[-1:]).permute(1, 0, 2)  # [X, D, d]
    o = hm.out_projs[layer]
    with torch.no_grad():
        z = torch.cat([torch.eye(H * d), torch.zeros(1, H * d)])
        w = o(z)
        if "post_norm" in hm.family.features:
            w = frozen(block.post_attention_layernorm, one)(w)
        out["O"] = (w[:-1] - w[-1:]).reshape(H, d, D)
    return out


@pytest.mark.parametrize("kind", ["gpt2", "qwen3", "olmo2", "gemma2", "llama"])
def test_matches_explicit_matrices_with_folded_norms(kind):
    hm = tiny_family_model(kind, "eager", initializer_range=0.1)
    _randomise_norms(hm)
    cs = composition_scores(hm, subtract_baseline=False)
    H, grp = hm.n_heads, hm.n_heads // hm.n_kv_heads
    eff = [_effective(hm, la) for la in range(hm.n_layers)]

    def fro(m):
        return torch.linalg.matrix_norm(m.double())

    for l2 in range(1, hm.n_layers):
        for l1 in range(l2):
            for h1 in range(H):
                ov1 = eff[l1]["V"][h1 // grp] @ eff[l1]["O"][h1]
                for h2 in range(H):
                    qk2 = eff[l2]["Q"][h2] @ eff[l2]["K"][h2 // grp].T
                    ov2 = eff[l2]["V"][h2 // grp] @ eff[l2]["O"][h2]
                    want = {
                        "q": fro(ov1 @ qk2) / (fro(ov1) * fro(qk2)),
                        "k": fro(ov1 @ qk2.T) / (fro(ov1) * fro(qk2)),
                        "v": fro(ov1 @ ov2) / (fro(ov1) * fro(ov2)),
                    }
                    for c, w in want.items():
                        assert abs(float(cs.raw[c][l1, h1, l2, h2]) - float(w)) < 1e-4, (
                            kind,
                            c,
                            l1,
                            h1,
                            l2,
                            h2,
                        )


def _hand_built(seed: int = 0, D: int = 128, d: int = 8, H: int = 2) -> HeadModel:
    """2 layers; head L0H0 writes residual dims 0..d-1 (its o_proj columns are the identity
    there); head L1H0's key reads exactly those dims; L1H1's value too. Everything else is random."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=D,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=H,
        head_dim=d,
        max_position_embeddings=64,
    )
    m = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    e = torch.zeros(D, d)
    e[:d] = torch.eye(d)
    with torch.no_grad():
        for la in range(2):
            a = m.model.layers[la].self_attn
            for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                p.weight.copy_(torch.randn(p.weight.shape, generator=g) / D**0.5)
        o0 = m.model.layers[0].self_attn.o_proj.weight
        o0[:, :d] = e  # L0H0 writes dims 0..d-1
        o0[:d, d:] = 0  # L0H1 writes nothing there
        m.model.layers[1].self_attn.k_proj.weight[:d] = e.T  # L1H0's key reads dims 0..d-1
        m.model.layers[1].self_attn.v_proj.weight[d:] = e.T  # L1H1's value reads dims 0..d-1
    return HeadModel(m, None, name="hand-built")


def test_hand_built_k_composition_stands_out():
    cs = composition_scores(_hand_built())
    base = cs.baseline
    assert 0.05 < base < 0.15
    k = cs.raw["k"][0, 0, 1, 0]
    assert k - base > 0.2  # 1/sqrt(d) = 0.35 for an exact d-dim match, ~4x the baseline
    assert float(cs.k[0, 0, 1, 0]) == pytest.approx(float(k) - base)
    for kind in ("q", "v"):  # the reader's query and value read random directions: ~ baseline
        assert abs(float(cs.raw[kind][0, 0, 1, 0]) - base) < 0.03, kind
    assert float(cs.raw["k"][0, 1, 1, 0]) == pytest.approx(0.0, abs=1e-6)  # L0H1 writes none of it
    assert cs.top("k", 1)[0][:2] == ((0, 0), (1, 0))


def test_baseline_is_deterministic_and_shrinks_with_width():
    a, b = baseline(64, 8, seed=3), baseline(64, 8, seed=3)
    assert a == b
    assert baseline(512, 8) < baseline(64, 8) < 1


def test_data_composition_matches_qk_attribution(tokenizer):
    hm = make_tiny("llama", tokenizer)
    ids = torch.randint(10, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    ds = data_composition_scores(hm, ids)
    assert ds.method == "data" and ds.baseline == 0.0
    layer, head = 2, 1
    r = qk_attribution(hm, ids, (layer, head), query=list(range(7)))
    vis = r.visible
    for side, kind in (("query", "q"), ("key", "k")):
        m = r.marginals(side).abs()
        for l1 in range(layer):
            for h1 in range(hm.n_heads):
                c = r.names.index(f"L{l1}H{h1}")
                want = float(m[..., c][vis].mean())
                assert float(ds.raw[kind][l1, h1, layer, head]) == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert torch.isnan(ds.raw["q"][2, 0, 1, 0]) and torch.isnan(ds.raw["v"][1, 0, 1, 0])


def test_data_v_composition_follows_the_value_subspace():
    hm = _hand_built()
    ds = data_composition_scores(hm, torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(1)))
    assert float(ds.raw["v"][0, 0, 1, 1]) > 0.01  # L1H1's value reads what L0H0 writes
    assert float(ds.raw["v"][0, 1, 1, 1]) == pytest.approx(0.0, abs=1e-6)  # L0H1 writes none of it


def test_result_views_and_files(tmp_path, tokenizer):
    hm = make_tiny("llama", tokenizer)
    cs = composition_scores(hm)
    df = cs.to_frame()
    assert len(df) == 3 * 16 and set(df.columns) >= {"writer_layer", "reader_head", "q", "k", "v", "baseline"}
    row = df[(df.writer_layer == 0) & (df.writer_head == 1) & (df.reader_layer == 2) & (df.reader_head == 3)]
    assert float(row.k.iloc[0]) == pytest.approx(float(cs.k[0, 1, 2, 3]))
    hs = cs.head_scores("k", reader=(2, 3))
    assert hs.scores.shape == (3, 4) and torch.isnan(hs.scores[2]).all()
    assert float(hs.scores[0, 1]) == pytest.approx(float(cs.k[0, 1, 2, 3]))
    best = cs.head_scores("q")
    assert torch.isnan(best.scores[0]).all() and not torch.isnan(best.scores[1:]).any()
    assert cs.pair((0, 1), (2, 3))["v"] == pytest.approx(float(cs.v[0, 1, 2, 3]))
    assert math.isnan(cs.pair((2, 1), (1, 3))["q"])
    path = cs.save(tmp_path / "comp.json")
    back = CompositionScores.load(path, hm)
    for kind in "qkv":
        assert torch.equal(torch.isnan(back.raw[kind]), torch.isnan(cs.raw[kind]))
        assert torch.allclose(back.raw[kind].nan_to_num(), cs.raw[kind].nan_to_num())
    assert back.baseline == cs.baseline and back.method == "weights"
    with pytest.raises(ValueError, match="exists"):
        cs.save(path)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match="symlink"):
        cs.save(link, overwrite=True)
    assert not (tmp_path / "elsewhere.json").exists()
    other = make_tiny("gpt2", tokenizer)
    with pytest.raises(ValueError, match="n_layers, n_heads"):
        CompositionScores.load(path, other)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "headsteer/composition-scores", "schema_version": 1, "scores": {"q": 1}}')
    with pytest.raises(ValueError, match="malformed"):
        CompositionScores.load(bad)
    with pytest.raises(ValueError, match="kind must be"):
        cs.get("x")
    with pytest.raises(ValueError, match="reader or writer"):
        cs.head_scores("k", reader=(1, 0), writer=(0, 0))


def test_refuses_latent_attention_by_name():
    hm = tiny_family_model("deepseek_v2")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        composition_scores(hm)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        qk_attribution(hm, torch.tensor([3, 4, 5]), (0, 0))


def test_square_root_of_the_gram_matrix_also_when_rank_deficient():
    from heads.scorers.qk.composition import _r

    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 40, 6, generator=g, dtype=torch.float64)
    low = full.clone()
    low[:, :, 5] = low[:, :, 0]  # rank 5 of 6: no Cholesky factor
    for w in (full, low):
        r = _r(w)
        assert torch.allclose(r.transpose(-1, -2) @ r, w.transpose(-1, -2) @ w, atol=1e-8)


def test_chosen_readers_give_the_same_columns(tokenizer):
    hm = make_tiny("llama", tokenizer)
    full = composition_scores(hm)
    part = composition_scores(hm, readers=[(2, 3), (1, 0)])
    for kind in "qkv":
        for la, h in ((2, 3), (1, 0)):
            a, b = part.raw[kind][:, :, la, h], full.raw[kind][:, :, la, h]
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            assert torch.allclose(a.nan_to_num(), b.nan_to_num(), atol=1e-6)
        assert torch.isnan(part.raw[kind][:, :, 2, 0]).all()
    with pytest.raises(ValueError, match="unknown layer 5"):
        composition_scores(hm, readers=[(5, 0)])
    with pytest.raises(ValueError, match="readers must be"):
        composition_scores(hm, readers=[])
    by_layer = composition_scores(hm, readers={2: [3], 1: [0]})  # the requests' mapping form
    for kind in "qkv":
        assert torch.equal(by_layer.raw[kind].isnan(), part.raw[kind].isnan())
        assert torch.equal(by_layer.raw[kind].nan_to_num(), part.raw[kind].nan_to_num())


@pytest.mark.parametrize("n", [0, 100_001, 10**9, 10**30])
def test_n_samples_is_capped_before_any_work(tokenizer, n):
    hm = make_tiny("llama", tokenizer)
    with pytest.raises(ValueError, match=r"n_samples"):
        composition_scores(hm, n_samples=n)
    with pytest.raises(ValueError, match=r"n_samples"):
        baseline(64, 8, n_samples=n)


def test_baseline_in_chunks_is_the_mean_over_its_draws():
    """Past 128 pairs the draws come 128 at a time: the mean over 300 pairs is the weighted mean
    of the chunks', each the baseline of its own draws (an independent re-computation)."""
    g = torch.Generator().manual_seed(1)
    vals = []
    for n in (128, 128, 44):
        x1, x2 = (torch.randn(n, 32, 4, generator=g, dtype=torch.float64) for _ in range(2))
        y1, y2 = (torch.randn(n, 4, 32, generator=g, dtype=torch.float64) for _ in range(2))
        w1, w2 = x1 @ y1, x2 @ y2  # the full [D, D] factors: ||W1 W2|| / (||W1|| ||W2||)
        mn = torch.linalg.matrix_norm
        vals.append(mn(w1 @ w2) / (mn(w1) * mn(w2)))
    assert baseline(32, 4, n_samples=300, seed=1) == pytest.approx(float(torch.cat(vals).mean()), rel=1e-9)


@pytest.mark.parametrize("n", [100_001, 10**30])
def test_composition_request_caps_n_samples(tokenizer, n):
    from heads import run
    from heads.scorers.qk.request import CompositionRequest

    with pytest.raises(ValueError, match="n_samples"):
        CompositionRequest(n_samples=n)
    with pytest.raises(ValueError, match="n_samples"):
        run(make_tiny("llama", tokenizer), {"request": "composition_scores", "n_samples": n})


def test_qk_request_reads_the_head_forms():
    from heads.scorers.qk.request import QKRequest

    assert QKRequest(head="L1.H2").head == QKRequest(head="1.2").head == (1, 2)
    for bad in ("9" * 5000 + ".1", "\u00b9.2"):
        with pytest.raises(ValueError, match="L.H"):
            QKRequest(head=bad)

"""Circuit discovery: the decomposed forward, EAP / EAP-IG / exact edge scores, circuits.

Oracles: the model's own forward (decomposition), a plainly written two-run patch (one edge),
a linear toy model on which first-order attribution is exact, and f(full) = 1, f(empty) = 0.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from heads.errors import HeadsteerValueError
from heads.inputs.prompts import position_ids
from heads.scorers.circuits import (
    Circuit,
    edge_scores,
    evaluate,
    exact_scores,
    faithfulness_curve,
    graph_of,
    prune,
    select,
)
from heads.scorers.circuits.graph import run_graph
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


def _pairs(n: int = 2, t: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 300, (n, t), generator=g).tolist()
    corr = torch.randint(3, 300, (n, t), generator=g).tolist()
    clean[0] = clean[0][1:]  # one shorter pair: left padding is exercised
    corr[0] = corr[0][1:]
    return pairs_from_tokens(clean, corr, list(range(5, 5 + n)), list(range(40, 40 + n)))


def _model_logits(m, ids, mask):
    with torch.no_grad():
        out = m.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    return out.logits[:, -1].float()


@pytest.fixture(scope="module")
def qwen2():
    return tiny_family_model("qwen2")


# ------------------------------------------------------------------------------ the graph
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "gemma", "phi3"])
def test_decomposition_reproduces_the_model(kind):
    m = tiny_family_model(kind)
    g = graph_of(m)
    p = _pairs()
    ids, corr_ids, mask = p.clean_ids, p.corrupted_ids, p.attention_mask
    ref = _model_logits(m, ids, mask)
    ref_corr = _model_logits(m, corr_ids, mask)
    everything = g.valid[None].expand(p.n, -1, -1)
    with torch.no_grad():
        _, rc = run_graph(m, g, ids, mask, record=True)
        _, rx = run_graph(m, g, corr_ids, mask, record=True)
        # every edge patched with the clean run's own outputs: the per-head path, no change
        same, _ = run_graph(m, g, ids, mask, patch=everything, corr=rc.acts())
        # every edge corrupted: the corrupted run
        allx, _ = run_graph(m, g, ids, mask, patch=everything, corr=rx.acts())
    with torch.enable_grad():
        grad_path, _ = run_graph(m, g, ids, mask, grad=True)
    assert (same - ref).abs().max() < 1e-5
    assert (grad_path.detach() - ref).abs().max() < 1e-5
    assert (allx - ref_corr).abs().max() < 1e-5
    # the residual is the sum of the upstream outputs (plus the o_proj / MLP biases)
    acts = rc.acts()
    w_o = [m.layer_weights(la)["W_O"] for la in range(g.n_layers)]
    assert acts.upstream(w_o).shape == (g.n_upstream, p.n, p.width, m.d_model)
    names = g.downstream_names()
    if m.n_kv_heads < m.n_heads:  # GQA: k / v edges go to the KV head
        assert f"a1.g{m.n_kv_heads - 1}<k>" in names and "a1.g0<v>" in names
    assert g.n_downstream == g.n_layers * (m.n_heads + 2 * m.n_kv_heads + 1) + 1


@pytest.mark.parametrize("kind", ["phi", "gpt_neox"])
def test_refused_families_are_named(kind):
    m = tiny_family_model(kind)
    with pytest.raises(HeadsteerValueError, match=f"model_type '{kind}'"):
        graph_of(m)
    with pytest.raises(HeadsteerValueError, match=f"model_type '{kind}'"):
        edge_scores(m, _pairs(), progress=False)


# ------------------------------------------------------------------------------ scores
def _linear_toy():
    """A tiny Llama made linear: identity norms, zero q/k (fixed uniform attention), linear MLPs."""
    m = tiny_family_model("llama")
    torch.manual_seed(0)
    d = m.d_model
    for b in m.model.model.layers:
        b.input_layernorm = nn.Identity()
        b.post_attention_layernorm = nn.Identity()
        b.mlp = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            b.self_attn.q_proj.weight.zero_()
            b.self_attn.k_proj.weight.zero_()
    m.model.model.norm = nn.Identity()
    return m


def test_linear_toy_eap_equals_exact():
    m = _linear_toy()
    p = _pairs()
    eap = edge_scores(m, p, method="eap", progress=False)
    ex = exact_scores(m, p, progress=False)
    a, b = eap.values(), ex.values()
    assert b.abs().max() > 1e-4  # the edges do move the metric
    assert torch.allclose(a, b, atol=1e-6 * float(b.abs().max()) + 1e-8, rtol=1e-4)


def test_eap_ig_one_step_is_eap_and_chunking_is_invariant(qwen2):
    p = _pairs(3)
    eap = edge_scores(qwen2, p, method="eap", progress=False)
    ig1 = edge_scores(qwen2, p, method="eap-ig", steps=1, batch_size=1, progress=False)
    assert torch.allclose(eap.values(), ig1.values(), atol=1e-6)
    ig = edge_scores(qwen2, p, method="eap-ig", steps=3, confirm=4, progress=False)
    assert not torch.allclose(ig.values(), eap.values(), atol=1e-6)
    top = ig.ranking()[:4]
    ex = exact_scores(qwen2, p, edges=top, progress=False)
    got = ig.exact[top[:, 0], top[:, 1]]
    assert torch.allclose(got, ex.scores[top[:, 0], top[:, 1]], atol=1e-6)
    assert int((~ig.exact.isnan()).sum()) == 4


def _two_run_oracle(m, p, layer0_head: int, target: str) -> float:
    """M(clean with head (0, h)'s contribution to one input of layer 1 corrupted) - M(clean),
    written with plain hooks: record z on both runs, add the difference through W_O[0, h]."""
    d = m.d_head
    w_o = m.layer_weights(0)["W_O"][layer0_head]  # [d, D]
    zs = {}

    def rec(name):
        def hook(mod, args):
            zs[name] = args[0][..., layer0_head * d : (layer0_head + 1) * d].clone()

        return hook

    ids, mask = p.clean_ids, p.attention_mask
    for name, x in (("clean", ids), ("corr", p.corrupted_ids)):
        h = m.out_projs[0].register_forward_pre_hook(rec(name))
        clean_logits = _model_logits(m, x, mask)
        h.remove()
        if name == "clean":
            base = clean_logits
    delta = (zs["corr"] - zs["clean"]) @ w_o  # [N, T, D]
    block = m.layers[1]
    if target == "mlp":
        h = block.post_attention_layernorm.register_forward_pre_hook(lambda mod, args: (args[0] + delta,))
        patched = _model_logits(m, ids, mask)
        h.remove()
    else:  # k of KV head 0 of layer 1: only k_proj sees the corrupted contribution
        saved = {}
        h1 = block.input_layernorm.register_forward_pre_hook(lambda mod, args: saved.update(x=args[0]))

        def kh(mod, args, out):
            new = nn.functional.linear(block.input_layernorm(saved["x"] + delta), mod.weight, mod.bias)
            out = out.clone()
            out[..., :d] = new[..., :d]  # KV head 0's block
            return out

        h2 = block.self_attn.k_proj.register_forward_hook(kh)
        patched = _model_logits(m, ids, mask)
        h1.remove()
        h2.remove()
    idx = torch.arange(p.n)
    ld = (patched[idx, p.answers[:, 0]] - patched[idx, p.counterfactuals[:, 0]]) - (
        base[idx, p.answers[:, 0]] - base[idx, p.counterfactuals[:, 0]]
    )
    return float(ld.mean())


def test_exact_one_edge_equals_two_run_oracle(qwen2):
    p = _pairs(2)
    g = graph_of(qwen2)
    edges = torch.tensor([[g.head_node(0, 1), g.mlp_input(1)], [g.head_node(0, 2), g.k_input(1, 0)]])
    ex = exact_scores(qwen2, p, edges=edges, progress=False)
    want_mlp = _two_run_oracle(qwen2, p, 1, "mlp")
    want_k = _two_run_oracle(qwen2, p, 2, "k")
    assert abs(want_mlp) > 1e-5 and abs(want_k) > 1e-6
    assert ex.scores[edges[0, 0], edges[0, 1]].item() == pytest.approx(want_mlp, abs=1e-5)
    assert ex.scores[edges[1, 0], edges[1, 1]].item() == pytest.approx(want_k, abs=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_sliced_projection_equals_the_module_path(kind, monkeypatch):
    """The sliced-weight projection of per-head copies (and patching only the active inputs)
    gives the numbers of calling the module on every copy: EAP scores, exact scores of edges
    into q / k / v / MLP / logits, and a many-edge faithfulness evaluation."""
    import heads.scorers.circuits.graph as graph_mod

    m = tiny_family_model(kind)
    p = _pairs(2)
    g = graph_of(m)
    edges = torch.tensor(
        [
            [g.head_node(0, 1), g.q_input(1, 2)],
            [g.head_node(0, 0), g.k_input(1, 0)],
            [0, g.v_input(1, g.n_kv_heads - 1)],
            [g.mlp_node(0), g.mlp_input(1)],
            [g.head_node(1, 0), g.logits_input],
        ]
    )
    masks = torch.rand(3, g.n_upstream, g.n_downstream, generator=torch.Generator().manual_seed(0)) < 0.5
    got = []
    for fast in (True, False):
        monkeypatch.setattr(graph_mod, "_FAST_LINEAR", fast)
        eap = edge_scores(m, p, method="eap", progress=False).values()
        ex = exact_scores(m, p, edges=edges, batch_rows=4, progress=False).scores[edges[:, 0], edges[:, 1]]
        got.append((eap, ex, evaluate(m, p, masks & g.valid, batch_rows=3)))
    for a, b in zip(got[0], got[1], strict=True):
        assert not a.isnan().any()
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    assert got[0][1].abs().max() > 1e-6


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_skipped_layers_give_the_full_forward(kind, monkeypatch):
    """Exact patching of every edge with the layers below each batch's first patched input
    skipped (their clean outputs reused) gives the scores of running every layer, and the
    skip happens: layer 0's attention norm runs fewer times."""
    import heads.scorers.circuits.graph as graph_mod
    from heads.scorers.circuits.graph import ATTN_NORMS, first_patched_layer

    m = tiny_family_model(kind)
    p = _pairs(2)
    g = graph_of(m)
    assert g.n_layers >= 2
    block0 = m.layers[0]
    norm0 = next(getattr(block0, n) for n in ATTN_NORMS if hasattr(block0, n))
    calls = [0]
    handle = norm0.register_forward_pre_hook(lambda mod, args: calls.__setitem__(0, calls[0] + 1))
    got, n_calls = [], []
    try:
        for skip in (True, False):
            monkeypatch.setattr(graph_mod, "_SKIP_LAYERS", skip)
            calls[0] = 0
            ex = exact_scores(m, p, batch_rows=8, progress=False)
            got.append(ex.values())
            n_calls.append(calls[0])
    finally:
        handle.remove()
    assert not got[0].isnan().any()
    assert torch.allclose(got[0], got[1], atol=1e-6, rtol=1e-5), (got[0] - got[1]).abs().max()
    assert got[0].abs().max() > 1e-6
    assert n_calls[0] < n_calls[1]
    # a patch below the skipped layers is refused, not silently mis-run
    monkeypatch.setattr(graph_mod, "_SKIP_LAYERS", True)
    patch = torch.zeros(1, g.n_upstream, g.n_downstream, dtype=torch.bool)
    patch[0, 0, g.q_input(0, 0)] = True
    assert first_patched_layer(g, patch) == 0
    with torch.no_grad():
        _, rc = run_graph(m, g, p.clean_ids[:1], p.attention_mask[:1], record=True)
        with pytest.raises(HeadsteerValueError, match="below layer 1"):
            run_graph(
                m, g, p.clean_ids[:1], p.attention_mask[:1], patch=patch, corr=rc.acts(), skip=(1, rc.acts())
            )


# ------------------------------------------------------------------------------ circuits
def test_pruning_drops_dangling_edges(qwen2):
    g = graph_of(qwen2)
    m = torch.zeros(g.n_upstream, g.n_downstream, dtype=torch.bool)
    m[g.head_node(0, 0), g.logits_input] = True  # a head without inputs: dangling
    m[0, g.mlp_input(0)] = True  # an MLP that reaches nothing: dangling
    assert not prune(g, m).any()
    m[0, g.k_input(0, 0)] = True  # feeds head 0 (KV group 0) -> kept with its output edge
    kept = prune(g, m)
    assert kept[g.head_node(0, 0), g.logits_input] and kept[0, g.k_input(0, 0)]
    assert not kept[0, g.mlp_input(0)]


def test_faithfulness_full_one_empty_zero_and_curve(qwen2, tmp_path):
    p = _pairs(2)
    sc = edge_scores(qwen2, p, method="eap", progress=False)
    g = sc.graph
    full = Circuit(g, g.valid.clone(), sc.scores)
    empty = Circuit(g, torch.zeros_like(g.valid), sc.scores)
    f = evaluate(qwen2, p, [full, empty])
    assert f[0].item() == pytest.approx(1.0, abs=1e-4) and f[1].item() == pytest.approx(0.0, abs=1e-4)
    cur = faithfulness_curve(qwen2, p, sc, sizes=(5, 50, 100))
    assert cur["faithfulness"][-1] == pytest.approx(1.0, abs=1e-4)
    assert cur["random"][-1] == pytest.approx(1.0, abs=1e-4)
    x = [0.05, 0.5, 1.0]
    area = torch.trapezoid(torch.tensor(cur["faithfulness"]), torch.tensor(x))
    assert cur["cpr"] == pytest.approx(float(area))
    # several random draws: the mean curve, and CPR / CMD averaged over the draws' own areas
    many = faithfulness_curve(qwen2, p, sc, sizes=(5, 50, 100), n_random=3, seed=0)
    assert many["random_draws"][0] == pytest.approx(cur["random"], abs=1e-6)  # draw 0 = seed 0's
    assert len(many["random_draws"]) == 3 and many["random_draws"][1] != many["random_draws"][0]
    mean = torch.tensor(many["random_draws"]).mean(0)
    assert many["random"] == pytest.approx(mean.tolist(), abs=1e-6)
    xs = torch.tensor(x)
    cmds = [float(torch.trapezoid((1 - torch.tensor(d)).abs(), xs)) for d in many["random_draws"]]
    assert many["cmd_random"] == pytest.approx(sum(cmds) / 3)
    assert many["cpr_random"] == pytest.approx(float(torch.trapezoid(mean, torch.tensor(x))))
    c = select(sc, 12)
    assert c.n_edges <= 12 and torch.equal(prune(g, c.mask), c.mask)
    df = c.to_frame()
    assert len(df) == c.n_edges and set(df["input"]) <= {"q", "k", "v", "mlp", "logits"}
    assert df["score"].abs().is_monotonic_decreasing
    hs = c.head_scores()
    assert tuple(hs.scores.shape) == (2, 4)
    # JSON round trip, validated against the model's geometry
    c.curve = cur
    path = c.save(tmp_path / "c.json")
    back = Circuit.load(path, qwen2)
    assert torch.equal(back.mask, c.mask) and back.curve == cur
    assert torch.allclose(back.scores.nan_to_num(), c.scores.nan_to_num())
    with pytest.raises(HeadsteerValueError, match="exists"):
        c.save(path)
    other = tiny_family_model("gpt2")  # 4 KV heads: another geometry
    with pytest.raises(HeadsteerValueError, match="n_kv_heads"):
        Circuit.load(path, other)
    d = json.loads(open(path).read())
    d["version"] = 99
    (tmp_path / "v.json").write_text(json.dumps(d))
    with pytest.raises(HeadsteerValueError, match="version"):
        Circuit.load(tmp_path / "v.json")


def test_circuit_heads_hand_off_to_ablate(qwen2):
    from steer import Ablate

    p = _pairs(2)
    c = select(edge_scores(qwen2, p, method="eap", progress=False), 20)
    assert c.heads.heads and all(0 <= la < 2 and 0 <= h < 4 for la, h in c.heads.heads)
    edits = Ablate(c.heads).edits(qwen2, None)  # type: ignore[arg-type]
    assert sorted(la for e in edits for la in [e.layer]) == sorted({la for la, _ in c.heads.heads})


@pytest.mark.parametrize("via", ["HeadScale", "Ablate-sc"])
def test_circuit_heads_reinforced_like_vhr(qwen2, via):
    """VHR's reinforcement (He et al. 2025, Sec. 3: o_{l,i} <- alpha o_{l,i}, the `HeadScale`
    edit `steer.Vhr` applies) takes `circuit.heads` directly: the logits equal a plain pre-hook
    on o_proj that multiplies the circuit heads' slices by alpha, and differ from the unedited
    ones."""
    from heads import editing
    from heads.engine.edits import HeadScale
    from steer import Ablate

    alpha, d = 2.0, qwen2.d_head
    p = _pairs(2)
    c = select(edge_scores(qwen2, p, method="eap", progress=False), 20)
    by_layer = c.heads.by_layer()
    assert by_layer and len(c.heads.heads) < qwen2.n_layers * qwen2.n_heads  # some heads left out
    edits: list = []
    if via == "HeadScale":
        edits = [HeadScale(layer=la, heads=hs, factor=alpha) for la, hs in by_layer.items()]
    else:
        edits = Ablate(c.heads, method="sc", eps=alpha).edits(qwen2, None)  # type: ignore[arg-type]
    ids, mask = p.clean_ids, p.attention_mask
    base = _model_logits(qwen2, ids, mask)
    with editing(qwen2, edits):
        got = _model_logits(qwen2, ids, mask)

    def oracle(chosen: dict[int, list[int]]) -> torch.Tensor:
        def scale(la):
            def hook(mod, args):
                z = args[0].clone()
                for hd in chosen[la]:
                    z[..., hd * d : (hd + 1) * d] *= alpha
                return (z, *args[1:])

            return hook

        hs = [qwen2.out_projs[la].register_forward_pre_hook(scale(la)) for la in chosen]
        try:
            out: torch.Tensor = _model_logits(qwen2, ids, mask)
            return out
        finally:
            for x in hs:
                x.remove()

    assert torch.allclose(got, oracle(by_layer), atol=1e-5)
    assert (got - base).abs().max() > 1e-3
    every = {la: list(range(qwen2.n_heads)) for la in range(qwen2.n_layers)}
    assert (got - oracle(every)).abs().max() > 1e-3  # the circuit's heads, not all of them


def test_bad_input_before_any_forward(qwen2):
    p = _pairs(2)
    calls = []
    h = qwen2.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(HeadsteerValueError, match="steps"):
            edge_scores(qwen2, p, steps=0, progress=False)
        with pytest.raises(HeadsteerValueError, match="method"):
            edge_scores(qwen2, p, method="acdc", progress=False)
        sc_graph = graph_of(qwen2)
        from heads.scorers.circuits import EdgeScores

        fake = EdgeScores(sc_graph, torch.zeros(sc_graph.n_upstream, sc_graph.n_downstream), "eap")
        for bad in ((0, 10), (10, 101), (-1,)):
            with pytest.raises(HeadsteerValueError, match="sizes"):
                faithfulness_curve(qwen2, p, fake, sizes=bad)
        with pytest.raises(HeadsteerValueError, match="n must be"):
            select(fake, 0)
        with pytest.raises(HeadsteerValueError, match="exactly one"):
            select(fake)
    finally:
        h.remove()
    assert not calls
    with pytest.raises(HeadsteerValueError, match="same token length|positions must align"):
        pairs_from_tokens([[5, 6, 7]], [[5, 6]], [5], [6])

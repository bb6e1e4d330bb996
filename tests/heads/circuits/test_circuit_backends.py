"""Circuits, the attribution estimate of Ships and the sink dimensions give the same numbers on
the `hf`, `transformer_lens` and `nnsight` backends (a tiny GQA Llama and a tiny GPT-2, fp32).

Three copies of one random model (same seed): plain Hugging Face, booted into a TransformerLens
`TransformerBridge` (no weight processing) and wrapped in an nnsight `TransformersModel`. The
Hugging Face numbers are checked against independent oracles elsewhere (tests/heads/circuits/
test_eap_reference.py, test_circuits.py, tests/heads/test_attribution.py); here every backend
must give them within 1e-5 (and within 1e-3 relative to their scale, so a backend that returns
zeros for small values fails).
"""

from __future__ import annotations

import pytest
import torch

from heads import HeadModel, editing, encode_prompts, forward
from heads.scorers.circuits import edge_scores, exact_scores, find_circuit, graph_of
from heads.scorers.patching import pairs_from_tokens
from heads.scorers.safety.attribution import attribute
from heads.scorers.sink_dims import SinkTracker, find_sink_dims
from tests.support import make_tiny

NAMES = ("hf", "transformer_lens", "nnsight")


def _three(kind: str, tokenizer) -> dict[str, HeadModel]:
    from nnsight.modeling.transformers import TransformersModel
    from transformer_lens.model_bridge import TransformerBridge

    hf_model = make_tiny(kind, tokenizer).model
    tl = TransformerBridge.boot_transformers("tiny", hf_model=hf_model, tokenizer=tokenizer)
    ns = TransformersModel(make_tiny(kind, tokenizer).model, tokenizer=tokenizer)
    return {
        "hf": make_tiny(kind, tokenizer),
        "transformer_lens": HeadModel.wrap(tl, tokenizer),
        "nnsight": HeadModel.wrap(ns, tokenizer),
    }


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def models(request, tokenizer) -> dict[str, HeadModel]:
    return _three(request.param, tokenizer)


def _pairs():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, 3000, (2, 7), generator=g).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[2] = int(torch.randint(10, 3000, (1,), generator=g))
    clean[0], corr[0] = clean[0][1:], corr[0][1:]  # left padding
    return pairs_from_tokens(clean, corr, [5, 6], [40, 41])


def _same(values: dict[str, torch.Tensor], what: str) -> None:
    ref = values["hf"].double()
    scale = float(ref.nan_to_num().abs().max())
    assert scale > 1e-7, what  # the analysis measured something
    for name in NAMES[1:]:
        got = values[name].double()
        assert got.shape == ref.shape, (what, name)
        assert torch.equal(got.isnan(), ref.isnan()), (what, name)
        diff = float((got - ref).nan_to_num().abs().max())
        assert diff <= 1e-5 and diff <= 1e-3 * scale, (what, name, diff, scale)


def test_edge_scores_exact_patching_and_faithfulness(models):
    p = _pairs()
    g = graph_of(models["hf"])
    edges = torch.tensor(
        [
            [g.head_node(0, 1), g.q_input(1, 0)],
            [0, g.k_input(1, g.n_kv_heads - 1)],
            [g.mlp_node(0), g.v_input(1, 0)],
            [g.head_node(1, 0), g.logits_input],
        ]
    )
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, m in models.items():
        # EAP scores, the top half of the edges, its exact faithfulness (every other edge corrupted)
        circuit = find_circuit(m, p, method="eap", size=50, curve=False, progress=False)
        ig = edge_scores(m, p, method="eap-ig", steps=2, progress=False).values()
        ex = exact_scores(m, p, edges=edges, progress=False).scores[edges[:, 0], edges[:, 1]]
        out[name] = {
            "eap": circuit.scores[g.valid],
            "eap-ig": ig,
            "exact": ex,
            "faithfulness": torch.tensor([circuit.faithfulness]),
            "circuit_edges": circuit.mask.double(),
        }
    for what in out["hf"]:
        _same({n: out[n][what] for n in NAMES}, what)


def test_attribution_atp_and_atp_star(models):
    queries = ["Paris is the capital of", "The sky is"]
    for label, kw in (
        ("AtP (ua, linearised softmax)", dict(ablation="ua", saturation_fix=False)),
        ("AtP* (ua, saturation fix, GradDrop)", dict(ablation="ua", saturation_fix=True, graddrop=True)),
    ):
        got = {n: attribute(m, queries, **kw).per_prompt for n, m in models.items()}
        _same(got, label)


def test_sink_dims_and_tracker(models):
    prompts = ["The cat sat on the mat.", "Hello there, how are you?"]
    ev = {}
    for name, m in models.items():
        found = find_sink_dims(m, prompts, from_layer=1, min_ratio=1.0001)
        ev[name] = torch.tensor(found.evidence.sort_values("dim")["score"].tolist())
    _same(ev, "find_sink_dims scores")
    enc = encode_prompts(models["hf"].tokenizer, prompts, chat=False)
    flags = {}
    for name, m in models.items():
        tr = SinkTracker([0, 1, 2], 1.5, range(m.n_layers))
        with editing(m, tr.edits()):
            forward(m, enc)
        flags[name] = torch.stack([tr.flags[la] for la in range(m.n_layers)]).double()
    assert 0 < float(flags["hf"].mean()) < 1
    for name in NAMES[1:]:
        assert torch.equal(flags[name], flags["hf"]), name

"""The family matrix (issue 27): every causal-LM model type of transformers, exact or refused by name.

It walks `transformers`' causal-LM mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`). Each type is
exact (an entry of `heads.model.families.FAMILIES`), refused (`REFUSED`: a `ValueError` naming the
missing feature at load) or not applicable (`heads.model.support.NOT_APPLICABLE`). For every exact
family a tiny random model (2 layers, d_model 64, 4 heads, vocab 300; config in code, no download;
built once per family and kernel) shows:

(a) a read-only `Recorder` on every layer leaves the logits within 1e-5, on eager and SDPA;
(b) PASTA on one head changes the logits exactly as the closed form (Eq. 2 of Zhang et al. 2024:
    the head's attention outside the emphasised span scaled by alpha and renormalised, applied
    to the pattern by the test oracle `tests.support.oracle.pasta_eq2`), within 1e-5;
(c) UA query ablation of one head leaves every other head's pattern bitwise unchanged and makes
    the ablated head's row uniform over its visible keys (up to the sink's share with sinks);
(d) greedy generation under edits gives the same tokens with the KV cache on and off;
(e) a left-padded batch gives, under edits, the logits of the unpadded prompt run alone.

The support table in the docs (`docs/scripts/gen_families.py`) is generated from the same data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import pytest
import torch

from heads import HeadModel, HeadScale, LogitBias, ProbEdit, QueryScale, Recorder, editing
from heads.model.families import FAMILIES, FEATURES, REFUSED, family_of
from heads.model.support import NOT_APPLICABLE, causal_lm_types, status_of, support_rows
from steer.pasta.method import PastaBias
from tests.support.families import (
    N_VOCAB,
    SDPA_REFUSES,
    _tiny_config,
    family_inputs,
    shared_family_model,
    tiny_family_model,
)
from tests.support.oracle import pasta_eq2

EXACT = sorted(k for k, f in FAMILIES.items() if f.text_config is None and k in set(causal_lm_types()))
ALPHA = 0.05
SPAN = (4, 8)  # the emphasised key columns of the tests' prompts


# The family's tiny model, built once per session and kernel and shared with test_families.py
# (`long`: windows and chunks of 64 keys, so that a KV cache keeps absolute positions).
_model = shared_family_model
_inputs = family_inputs


@cache
def _plain(kind: str, attn: str = "eager") -> torch.Tensor:
    """The unedited logits of `_model(kind, attn)` on `_inputs()`, computed once (the tests only
    read them)."""
    ids, mask = _inputs()
    return _logits(_model(kind, attn), ids, mask)


@torch.no_grad()
def _logits(hm: HeadModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits with position ids counted from each row's first real token (absolute position
    embeddings, GPT-2 / OPT / BioGPT, would otherwise shift under left padding)."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return hm.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()


class _Eq2(ProbEdit):
    """The oracle as an edit: PASTA's Eq. 2 on the post-softmax pattern of the chosen heads.

    With learned sinks a row's mass on the keys, m, is below 1 and the sink keeps 1 - m:
    renormalising the scaled row `a` over keys and sink gives Eq. 2's `a / sum(a)` times
    `sum(a) / (sum(a) + 1 - m)`."""

    g_mask: torch.Tensor | None = None
    sinks: bool = False

    def apply(self, probs, call):
        heads = self.head_list(call.n_heads)
        out = pasta_eq2(probs, heads, self.g_mask, ALPHA, self.g_mask.shape[1])
        if self.sinks:
            k = probs.shape[-1]
            scale = torch.where(self.g_mask[:, :k], 1.0, ALPHA)[:, None, None, :]
            a = (probs[:, heads] * scale).sum(-1, keepdim=True)
            m = probs[:, heads].sum(-1, keepdim=True)
            out[:, heads] = out[:, heads] * (a / (a + 1 - m))
        return out


def _pasta(layer: int, head: int, mask: torch.Tensor, sinks: bool = False) -> tuple[PastaBias, _Eq2]:
    """PASTA on (layer, head) with span `SPAN` in every row, and the oracle edit."""
    g = torch.zeros(mask.shape, dtype=torch.bool)
    g[:, SPAN[0] : SPAN[1]] = True
    bias = torch.where(~g & mask.bool(), math.log(ALPHA), 0.0)
    oracle = _Eq2(layer=layer, heads=[head])
    oracle.g_mask = g | ~mask.bool()  # padding columns are masked anyway: leave them unscaled
    oracle.sinks = sinks
    return PastaBias(layer=layer, heads=[head], column_bias=bias), oracle


# -------------------------------------------------------------------------------- the table
def test_every_causal_lm_type_is_exact_refused_or_not_applicable():
    types = causal_lm_types()
    assert [t for t in types if status_of(t) == "unlisted"] == []
    assert not (set(FAMILIES) & set(REFUSED)) and not (set(FAMILIES) & set(NOT_APPLICABLE))
    assert not (set(REFUSED) & set(NOT_APPLICABLE))
    assert len(EXACT) >= 60
    assert {f for fam in FAMILIES.values() for f in fam.features} <= set(FEATURES)
    rows = {r["model_type"]: r for r in support_rows()}
    assert set(types) <= set(rows) and all(rows[k]["status"] == "exact" for k in EXACT)


@pytest.mark.parametrize("kind", sorted(k for k in REFUSED if k in set(causal_lm_types())))
def test_refused_family_names_the_missing_feature(kind):
    from transformers import CONFIG_MAPPING

    feature, _ = REFUSED[kind]
    try:
        config = CONFIG_MAPPING[kind]()
    except Exception:  # noqa: BLE001 - a config that needs arguments: refuse on a stand-in
        config = type("Config", (), {"model_type": kind})()
    with pytest.raises(
        ValueError, match=rf"model_type '{kind}' is not supported.*missing feature: {feature}"
    ):
        family_of(config)


def test_refused_family_is_refused_by_head_model_before_any_change():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=N_VOCAB, hidden_size=32, n_layer=1, n_head=4)).eval()
    impl = model.config._attn_implementation
    with pytest.raises(ValueError, match="'bloom' is not supported.*alibi"):
        HeadModel(model)
    assert model.config._attn_implementation == impl


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", EXACT)
def test_recorder_on_every_layer_is_read_only(kind):
    ids, mask = _inputs()
    real = mask.bool()
    for attn in ("eager", "sdpa"):
        if attn == "sdpa" and kind in SDPA_REFUSES:
            continue
        hm = _model(kind, attn)
        plain = _plain(kind, attn)
        with editing(hm, [Recorder(layer=la) for la in range(hm.n_layers)]):
            got = _logits(hm, ids, mask)
        assert (got[real] - plain[real]).abs().max().item() <= 1e-5, attn


@pytest.mark.parametrize("kind", EXACT)
def test_pasta_on_one_head_matches_the_closed_form(kind):
    hm = _model(kind)
    ids, mask = _inputs()
    real = mask.bool()
    layer, head = hm.n_layers - 1, 1
    pasta, oracle = _pasta(layer, head, mask, "learned_sinks" in hm.family.features)
    with editing(hm, [pasta]):
        steered = _logits(hm, ids, mask)
    with editing(hm, [oracle]):
        want = _logits(hm, ids, mask)
    assert (steered[real] - want[real]).abs().max().item() <= 1e-5
    assert (steered[real] - _plain(kind)[real]).abs().max().item() > 1e-6  # it acts


@pytest.mark.parametrize("kind", EXACT)
def test_ua_ablation_of_one_head_spares_the_others(kind):
    hm = _model(kind)
    ids, mask = _inputs()
    real = mask.bool()
    layer, head = 0, 2
    before, after = Recorder(layer=layer), Recorder(layer=layer)
    with editing(hm, [before]):
        _logits(hm, ids, mask)
    with editing(hm, [QueryScale(layer=layer, heads=[head], factor=0.0), after]):
        _logits(hm, ids, mask)
    (p0,), (p1,) = before.records, after.records
    others = [h for h in range(hm.n_heads) if h != head]
    assert torch.equal(p1[:, others], p0[:, others])
    row = p1[:, head][real]  # [n real queries, K]
    nonzero = row > 0
    share = row.sum(-1, keepdim=True) / nonzero.sum(-1, keepdim=True)  # a sink takes a share
    assert (torch.where(nonzero, row - share, 0.0)).abs().max().item() <= 1e-6


def _edits(hm: HeadModel, mask: torch.Tensor) -> list:
    pasta, _ = _pasta(0, 1, mask)
    return [pasta, QueryScale(layer=hm.n_layers - 1, heads=[3], factor=0.5)]


@dataclass(eq=False, repr=False)
class _AtPosition(LogitBias):
    """+2 on key column 0 for the query row at absolute position `position` only: wrong if the
    engine gets a call's first absolute position (`q_offset`) wrong at a decode step."""

    position: int = 0

    def bias(self, call):
        b = torch.zeros(1, 1, call.q_len, call.k_len, device=call.device)
        rows = call.query_positions == self.position
        b[0, 0, rows, 0] = 2.0
        return b


@pytest.mark.parametrize("kind", EXACT)
def test_cache_on_equals_cache_off_under_edits(kind):
    """Also with edits that depend on the absolute position of the query row (an attention-site
    bias, a head-output scale): GPT-BigCode passes its cache as `layer_past=`, which the engine
    missed, so at decode every call looked like position 0."""
    hm = _model(kind, long=True)
    ids, mask = _inputs(seq=8, pad=2)
    first_new = ids.shape[1]  # absolute position of the first generated token

    def run(cache: bool):
        positional = [
            _AtPosition(layer=0, heads=[2], position=first_new),
            HeadScale(layer=hm.n_layers - 1, heads=[1], factor=0.25, positions=[first_new]),
        ]
        with editing(hm, _edits(hm, mask) + positional):
            out = hm.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=2,
                do_sample=False,
                use_cache=cache,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1)

    (tok_c, log_c), (tok_n, log_n) = run(True), run(False)
    assert torch.equal(tok_c, tok_n)
    torch.testing.assert_close(log_c, log_n, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", EXACT)
def test_left_padded_batch_equals_single_runs_under_edits(kind):
    hm = _model(kind)
    pad = 3
    ids, mask = _inputs(pad=pad)
    with editing(hm, _edits(hm, mask)):
        batch = _logits(hm, ids, mask)
    single_ids, single_mask = ids[1:, pad:], mask[1:, pad:]  # the same columns emphasised, shifted
    g = torch.zeros(1, single_ids.shape[1], dtype=torch.bool)
    g[:, SPAN[0] - pad : SPAN[1] - pad] = True
    bias = torch.where(~g, math.log(ALPHA), 0.0)
    edits = [
        PastaBias(layer=0, heads=[1], column_bias=bias),
        QueryScale(layer=hm.n_layers - 1, heads=[3], factor=0.5),
    ]
    with editing(hm, edits):
        alone = _logits(hm, single_ids, single_mask)
    torch.testing.assert_close(batch[1, pad:], alone[0], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ features
def test_learned_sinks_in_both_kernels():
    """gpt-oss: PASTA on the fused kernel equals the blocked kernel and the oracle (the sink column)."""
    hm = tiny_family_model("gpt_oss")  # its own: the sinks are changed below
    assert "learned_sinks" in hm.family.features
    with torch.no_grad():
        for attn in hm.attentions:
            attn.sinks.normal_(0.0, 2.0)  # large sinks, so that dropping them would show
    ids, mask = _inputs()
    real = mask.bool()
    pasta, oracle = _pasta(1, 1, mask, sinks=True)
    with editing(hm, [pasta], kernel="blocked"):
        blocked = _logits(hm, ids, mask)
    with editing(hm, [pasta], kernel="fused"):
        fused = _logits(hm, ids, mask)
    with editing(hm, [oracle]):
        want = _logits(hm, ids, mask)
    assert (blocked[real] - want[real]).abs().max().item() <= 1e-5
    assert (fused[real] - want[real]).abs().max().item() <= 1e-5


def test_latent_attention_heads_are_the_decompressed_heads():
    """DeepSeek-V3 (MLA): a head is one decompressed query/key/value head; its output is its
    `v_head_dim` slice of the o_proj input; weight views are refused (no per-head W_Q)."""
    hm = _model("deepseek_v3")
    attn = hm.attentions[0]
    assert hm.d_head == attn.v_head_dim and hm.n_heads == hm.model.config.num_attention_heads
    with pytest.raises(ValueError, match="latent attention"):
        hm.layer_weights(0)


def test_per_head_fused_qkv_weight_views():
    """GPT-NeoX / Persimmon lay out query_key_value head by head; GPT-BigCode (MQA) in blocks."""
    for kind in ("gpt_neox", "persimmon", "gpt_bigcode"):
        hm = _model(kind)
        proj = getattr(hm.attentions[0], hm.family.qkv_proj)
        x = torch.randn(5, hm.d_model)
        with torch.no_grad():
            out = proj(x) - proj.bias
        if hm.family.qkv_layout == "per_head":
            q = out.view(5, hm.n_heads, 3, hm.d_head)[:, :, 0].reshape(5, -1)
        else:
            q = out[:, : hm.n_heads * hm.d_head]
        torch.testing.assert_close(torch.einsum("nm,hmd->nhd", x, hm.W_Q[0]).reshape(5, -1), q)


def test_moe_mlp_runs_in_maps_first_mlp():
    """MAPS' first-MLP source representation routes rows through the experts (Mixtral)."""
    from heads.scorers.maps.static import first_mlp

    hm = _model("mixtral")
    x = torch.randn(3, hm.d_model)
    with torch.no_grad():
        got = first_mlp(hm, x)
        block = hm.layers[0]
        want = block.mlp(block.post_attention_layernorm(x)[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="not one module"):
        first_mlp(_model("opt"), x)


def test_load_model_picks_eager_for_families_without_sdpa(tmp_path, tokenizer):
    """Gemma 2 / gpt-oss refuse SDPA in transformers: load_model chooses eager by itself."""
    from transformers import AutoModelForCausalLM

    from heads import load_model
    from heads.model.loading import pick_attn_implementation

    for kind in ("gemma2", "gpt_oss", "llama"):
        folder = tmp_path / kind
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_tiny_config(kind)).save_pretrained(folder)
        want = "sdpa" if kind == "llama" else "eager"
        assert pick_attn_implementation(folder, None) == want
    tokenizer.save_pretrained(tmp_path / "gemma2")
    hm = load_model(tmp_path / "gemma2")
    assert hm.model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        load_model(tmp_path / "gemma2", attn_implementation="sdpa")


def test_docs_support_table_is_generated_from_the_table():
    """docs/families.md is `docs/scripts/gen_families.py`'s output (regenerate it after a change)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "docs" / "scripts" / "gen_families.py"
    spec = importlib.util.spec_from_file_location("gen_families", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (root / "docs/families.md").read_text() == gen.render()


@pytest.mark.parametrize("kind", EXACT)
def test_every_stream_site_reads_without_change_and_adds_up(kind):
    """Every activation site the family has (`heads.hook_names`, patterns left out) is read in one
    forward without changing a bit of the logits; in a sequential block the stream is the sum
    the block forms (`resid_mid = resid_pre + attn_out`, `resid_post = resid_mid + mlp_out`, bit
    for bit), and a replacement by the value read is the identity."""
    from heads.engine.activations import ActivationEdit, ActivationRecorder
    from heads.engine.hooks import _split, hook_names

    ids, mask = _inputs()
    hm = _model(kind, "eager")
    names = [n for n in hook_names(hm) if not n.endswith(("hook_pattern", "hook_attn_scores", "hook_rot_q"))]
    recs = {n: ActivationRecorder(*_split(n)) for n in names}
    with editing(hm, list(recs.values())):
        got = _logits(hm, ids, mask)
    assert torch.equal(got, _plain(kind, "eager"))
    last = hm.n_layers - 1
    if f"blocks.{last}.hook_resid_mid" in recs:
        (pre,), (attn,), (mid,) = (
            recs[f"blocks.{last}.{h}"].records for h in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid")
        )
        (mlp,), (post,) = (recs[f"blocks.{last}.{h}"].records for h in ("hook_mlp_out", "hook_resid_post"))
        assert torch.equal(mid, pre + attn) and torch.equal(post, mid + mlp)
        ident = [
            ActivationEdit(s, last, lambda x, call: x.clone()) for s in ("resid_mid", "mlp_out", "attn_out")
        ]
        with editing(hm, ident):
            assert torch.equal(_logits(hm, ids, mask), got)

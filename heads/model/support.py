"""Which `transformers` causal-LM model types headsteer supports, as data.

Every `model_type` of `transformers`' causal-LM mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`,
transformers 5.23) is in exactly one of three groups:

* **exact**: an entry of the family table (`heads.model.families.FAMILIES`); the family matrix
  (`tests/heads/test_family_matrix.py`) proves on a tiny random model that headsteer's attention
  is the family's own plus the edit;
* **refused**: a decoder-only language model whose attention the edit engine does not
  reproduce; `heads.model.families.REFUSED` names the missing feature, and `HeadModel(...)` /
  `load_model` raise a `ValueError` with it (`family_of`);
* **not applicable**: no decoder-only softmax-attention language model to steer (encoders used
  as causal LMs, encoder-decoders, state-space / recurrent models, multimodal wrappers
  whose text model is listed under its own type); `NOT_APPLICABLE` says which.

`support_rows()` turns the three into the rows of the support table in the docs
(`docs/scripts/gen_families.py` writes `docs/families.md` from it), so the table and the matrix read
the same data and cannot drift.
"""

from __future__ import annotations

from heads.model.families import FAMILIES, REFUSED

__all__ = ["NOT_APPLICABLE", "REFUSED", "causal_lm_types", "status_of", "support_rows"]

_ENCODER = "encoder (bidirectional masked LM used as a decoder)"
_ENC_DEC = "encoder-decoder"
_SSM = "state-space / recurrent model (no softmax attention)"
_WRAPPER = "multimodal wrapper (its text model is listed under its own model_type, or none is a plain LM)"

NOT_APPLICABLE: dict[str, str] = {
    **dict.fromkeys(
        (
            "bert",
            "bert-generation",
            "big_bird",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "megatron-bert",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "xlm",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xlnet",
            "xmod",
            "reformer",
        ),
        _ENCODER,
    ),
    **dict.fromkeys(
        (
            "bart",
            "bigbird_pegasus",
            "blenderbot",
            "blenderbot-small",
            "marian",
            "mbart",
            "mvp",
            "pegasus",
            "plbart",
            "prophetnet",
            "trocr",
            "whisper",
            "musicgen",
            "musicgen_melody",
            "moss_transcribe_diarize",
        ),
        _ENC_DEC,
    ),
    **dict.fromkeys(("falcon_mamba", "mamba", "mamba2", "rwkv", "xlstm"), _SSM),
    **dict.fromkeys(
        (
            "aria",
            "blt",
            "dots3_note",
            "emu3",
            "fuyu",
            "gemma3n",
            "gemma4",
            "gemma4_assistant",
            "gemma4_unified",
            "gemma4_unified_assistant",
            "git",
            "got_ocr2",
            "llama4",
            "mllama",
            "phi4_multimodal",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen4_exp",
        ),
        _WRAPPER,
    ),
}
"""Causal-LM model types with no decoder-only softmax-attention LM to steer: `model_type -> why`."""

BACKENDS_TESTED: dict[str, tuple[str, ...]] = {
    "llama": ("hf", "transformer_lens", "nnsight"),
    "qwen2": ("hf", "transformer_lens", "nnsight"),
    "mistral": ("hf", "transformer_lens", "nnsight"),
    "gpt2": ("hf", "transformer_lens", "nnsight"),
}
"""Backends beyond `"hf"` with their own test suite (`tests/heads/test_backends.py`)."""


def causal_lm_types() -> list[str]:
    """Every `model_type` of `transformers`' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def status_of(model_type: str) -> str:
    """`"exact"`, `"refused"`, `"not applicable"` or `"unlisted"` (a type no table names)."""
    if model_type in FAMILIES:
        return "exact"
    if model_type in REFUSED:
        return "refused"
    if model_type in NOT_APPLICABLE:
        return "not applicable"
    return "unlisted"


def support_rows() -> list[dict[str, str]]:
    """One row per causal-LM model type (and per vision-language entry of the family table):
    `{"model_type", "status", "features", "why", "backends", "kernels"}`, sorted by status then
    name. `features` names `FEATURES` keys; `why` is the refusal reason or the category."""
    rows = []
    names = set(causal_lm_types()) | {k for k, f in FAMILIES.items() if f.text_config is not None}
    for name in sorted(names):
        status = status_of(name)
        fam = FAMILIES.get(name)
        row = {"model_type": name, "status": status, "features": "", "why": "", "backends": "", "kernels": ""}
        if fam is not None:
            feats = fam.features if fam.text_config is None else ("vision-language",)
            row["features"] = ", ".join(feats)
            row["backends"] = ", ".join(BACKENDS_TESTED.get(name, ("hf",)))
            row["kernels"] = "blocked, fused"
            if fam.attn_implementation:
                row["why"] = f"loads with attn_implementation={fam.attn_implementation!r}"
        elif status == "refused":
            feature, reason = REFUSED[name]
            row["features"], row["why"] = feature, reason
        elif status == "not applicable":
            row["why"] = NOT_APPLICABLE[name]
        rows.append(row)
    order = {"exact": 0, "refused": 1, "not applicable": 2, "unlisted": 3}
    return sorted(rows, key=lambda r: (order[r["status"]], r["model_type"]))

"""The two real-weight models of the `real` tests and what each test needs to know about them.

`tests/conftest.py`'s `real_model` fixture is parametrised over `REAL_MODELS`: it hands out the
session's `smol` (the embedded SmolLM2-135M-Instruct) or `gemma3` (the base Gemma-3-270m), each
loaded once per session, so a check written once runs on both families
(tests/heads/test_real_model.py); the checks only one family needs stay in that family's file."""

from __future__ import annotations

from dataclasses import dataclass

from heads.model.loading import EMBEDDED_MODEL, GEMMA3_MODEL
from viz.cli.demo import DEMO_PROMPT


@dataclass(frozen=True)
class RealModel:
    """What the shared real-model tests expect of one model."""

    fixture: str
    """The session fixture that loads it (tests/conftest.py)."""
    name: str
    """`HeadModel.name` (a name `load_model` knows)."""
    geometry: tuple[int, int, int, int, int]
    """`(n_layers, n_heads, n_kv_heads, d_head, d_model)`."""
    prompt: str
    """A prompt with one `**emphasised**` span, in the model's prompt format (the chat template
    for the instruction model, plain text for the base model: `encode_prompts`' default)."""
    top_k: int
    """Heads PASTA steers in the shared tests (the top of `span_attention`)."""


# A base-model prompt (no chat template): plain text that the answer continues.
GEMMA3_PROMPT = (
    "Bio: Ann is a nurse in Oslo who loves chess. **Reply in French.** Question: what is her job?\nAnswer:"
)

REAL_MODELS = (
    RealModel("smol", EMBEDDED_MODEL, (30, 9, 3, 64, 576), DEMO_PROMPT, top_k=20),
    RealModel("gemma3", GEMMA3_MODEL, (18, 4, 1, 256, 640), GEMMA3_PROMPT, top_k=8),
)
SPECS = {m.name: m for m in REAL_MODELS}
"""`HeadModel.name` -> its `RealModel`."""

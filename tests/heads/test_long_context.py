"""Long-context analyses keep memory linear in the prompt: the pattern readers (sink statistics,
the pattern detectors, the retrieval detector, QRHead) reduce the pattern block by block inside the
forward and never build a `[B, H, T, T]` tensor (nor full-vocabulary logits at every position),
and their results equal an oracle computed from the model's own full attention pattern
(Hugging Face eager attention with `output_attentions=True`, no headsteer code), also on a
sliding-window family with the prompt longer than the window."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import heads.engine.state as engine_state
from heads import encode_prompts
from heads.scorers.retrieval.qrhead import qr_tokens
from heads.scorers.roles.detectors import pattern_scores, retrieval_scores
from heads.scorers.sinks import SinkRule, column_scores, find_sinks, sink_stats
from tests.support import make_tiny
from tests.support.families import WINDOW

TEXT = (
    "The old lighthouse keeper climbed the stairs every evening, counted the ships on the horizon "
    "and wrote their names in a worn leather book. "
)


class _Largest(TorchDispatchMode):
    """Records the largest floating-point tensor any operation produces (views of the model's
    weights, such as a transposed unembedding, are not new memory and are skipped)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.weights = {p.untyped_storage().data_ptr() for p in model.model.parameters()}
        self.numel = 0
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() <= self.numel:
                continue
            if t.untyped_storage().data_ptr() not in self.weights:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


@pytest.fixture()
def small_blocks(monkeypatch):
    """Read blocks of 2 query rows per (batch row x head): many blocks on a short prompt."""
    monkeypatch.setattr(engine_state, "READ_BLOCK_ROW_HEADS", 8)
    monkeypatch.setattr(engine_state, "READ_BLOCK_ELEMENTS", 1)


def _run_sinks(model, text):
    return sink_stats(model, [text], chat=False, markup=False)


def _run_detectors(model, text):
    ids = model.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return pattern_scores(model, ids)


def _run_qrhead(model, text):
    passages = [s.strip() + "." for s in text.split(".") if s.strip()]
    return qr_tokens(model, "Who climbed the stairs?", passages, chat=False)


@pytest.mark.parametrize(
    "run", [_run_sinks, _run_detectors, _run_qrhead], ids=["sinks", "detectors", "qrhead"]
)
def test_pattern_readers_never_build_a_full_pattern(tiny_llama, small_blocks, run):
    text = TEXT * 6
    t = len(tiny_llama.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert t > 150
    with _Largest(tiny_llama) as largest:
        run(tiny_llama, text)
    # a full pattern is H * T^2 (4 T^2 here), full logits T * 49152; the model's own [1, 1, T, T]
    # mask and the read blocks [1, H, 2, T] stay under 2 T^2
    assert largest.numel < 2 * t * t, largest.shape


def _eager(kind, tokenizer):
    """Tiny eager Llama, or Mistral with a sliding window of 6 keys (the prompts are far longer)."""
    if kind == "llama":
        return make_tiny("llama", tokenizer, attn="eager")
    return make_tiny("mistral", tokenizer, attn="eager", sliding_window=WINDOW)


def _native_patterns(model, ids):
    """`[L][H, T, T]` patterns from the model's own eager attention (no headsteer edit)."""
    with torch.no_grad():
        out = model.model(input_ids=ids, output_attentions=True, use_cache=False)
    return [a[0].float() for a in out.attentions]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_sink_stats_in_blocks_equal_the_full_pattern(tokenizer, small_blocks, kind):
    """Column sums reduced in blocks equal `column_scores` / `find_sinks` on the model's own full
    pattern; Mistral's sliding window (6) is far shorter than the prompt."""
    model = _eager(kind, tokenizer)
    text = TEXT * 2
    stats = sink_stats(model, [text], chat=False, markup=False, rule=SinkRule(rule="absolute", theta=0.05))
    enc = encode_prompts(model.tokenizer, [text], chat=False, markup=False)
    real = enc.attention_mask.bool()
    n_rows = real.sum()
    for la, p in enumerate(_native_patterns(model, enc.input_ids)):
        a, n = column_scores(p[None], real)
        s = find_sinks(a, n, real, SinkRule(rule="absolute", theta=0.05))
        want_sink = (p[None] * s[:, :, None, :]).sum((-1, -2))[0] / n_rows
        torch.testing.assert_close(stats.sink_mass.scores[la], want_sink, atol=1e-5, rtol=0)
        first = p[:, :, 0].sum(-1) / n_rows
        torch.testing.assert_close(stats.first_mass.scores[la], first, atol=1e-5, rtol=0)
        torch.testing.assert_close(stats.n_sinks.scores[la], s[0].sum(-1).float(), atol=0, rtol=0)


def test_sink_stats_padded_batch_equals_rows_alone(tiny_llama, small_blocks):
    texts = [TEXT, TEXT * 2]
    rule = SinkRule(rule="absolute", theta=0.05)
    batch = sink_stats(tiny_llama, texts, chat=False, markup=False, rule=rule)
    alone = [sink_stats(tiny_llama, [t], chat=False, markup=False, rule=rule) for t in texts]
    for name in ("sink_mass", "first_mass", "n_sinks"):
        mean = torch.stack([getattr(a, name).scores for a in alone]).mean(0)
        torch.testing.assert_close(getattr(batch, name).scores, mean, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_detectors_in_blocks_equal_the_full_pattern(tokenizer, small_blocks, kind):
    """Previous-token, self and induction scores (rows='all': every real row counted) from blocks
    equal the same ratios computed on the model's own full pattern of [BOS] + R + R."""
    model = _eager(kind, tokenizer)
    g = torch.Generator().manual_seed(3)
    r = torch.randint(100, 4000, (20,), generator=g)
    ids = torch.cat([torch.tensor([1]), r, r])[None]
    got = pattern_scores(model, ids, rows="all", detectors=("previous_token", "self", "induction"))
    t = ids.shape[1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    masks = {
        "previous_token": j == i - 1,
        "self": j == i,
        # key j follows an earlier copy of token i: tok[j - 1] == tok[i], j - 1 < i, j <= i
        "induction": torch.zeros(t, t, dtype=torch.bool),
    }
    masks["induction"][:, 1:] = (ids[0][:, None] == ids[0][None, :-1]) & (j[:, :-1] < i) & (j[:, 1:] <= i)
    for la, p in enumerate(_native_patterns(model, ids)):
        for name, d in masks.items():
            want = (p * d).sum((-1, -2)) / p.sum((-1, -2))
            torch.testing.assert_close(got[name].scores[la], want, atol=1e-5, rtol=0)


def test_retrieval_detector_reads_only_the_answer_rows(tiny_llama, monkeypatch):
    """The retrieval detector's recorders get the answer rows only (a few of a long haystack)."""
    from heads.engine.edits import Recorder
    from heads.scorers.roles.detectors import needle_prompts

    seen: list[tuple[int, int]] = []
    apply = Recorder.apply

    def spy(self, probs, call):
        out = apply(self, probs, call)
        if self.records:
            seen.append((call.q_offset, call.q_len))
        return out

    monkeypatch.setattr(Recorder, "apply", spy)
    scores = retrieval_scores(tiny_llama, n_prompts=2, n_filler=20, seed=1)
    enc, _, answers = needle_prompts(tiny_llama, n_prompts=2, n_filler=20, seed=1)
    lo, hi = min(a for a, _ in answers) - 1, max(b for _, b in answers) - 1
    assert enc.length > 4 * (hi - lo) and seen
    assert all(lo <= q and q + n <= hi for q, n in seen) and scores.scores.shape == (3, 4)


def test_query_range_is_checked(tiny_llama):
    from heads import Recorder, editing

    for bad in ((3, 3), (-1, 4), (5, 2)):
        with pytest.raises(ValueError, match="query_range"):
            with editing(tiny_llama, Recorder(layer=0, query_range=bad)):
                pass
    with pytest.raises(TypeError, match="query_range"):
        with editing(tiny_llama, Recorder(layer=0, query_range="0:4")):  # type: ignore[arg-type]
            pass

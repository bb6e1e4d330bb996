"""QRHead: query-focused retrieval heads and the attention retriever built on them (Zhang, Shen, Chen,
Xia, Durrett, Chen, "Query-Focused Retrieval Heads Improve Long-Context Reasoning and Re-ranking",
EMNLP 2025, arXiv:2506.09944; reference code `princeton-pli/QRHead`; docs/methods/qrhead.md).

Prompt. The passages, numbered `[1] ... [n]`, then an instruction and the query
(`qr_prompt`). The *query rows* Q are the tokens from the instruction after the passages to the end
of the prompt (the reference's `query_content`: the late instruction, `Query: {q}` and the chat
template's closing tokens).

Per-token score. For head (l, h) and key token j (shape letters of `heads`: L layers, H heads,
P prompt tokens):

    s_{l,h}(j) = mean_{i in Q} A_{l,h}[i, j]                                   [L, H, P]

and its calibration by a null query (default `"N/A"`, the reference's), whose prompt is identical
up to the query rows: `c = s(query) - s(null)` on the common key columns.

Passage score. For passage d with token set T_d and a score vector x over its tokens, drop the
outliers below `mean(x) - 2 std(x)` (unbiased std) and sum the rest:

    score_d(x) = sum_{j in T_d} x_j 1[x_j > mean_{T_d} x - 2 std_{T_d} x].

* Head detection (`qrhead_scores`): per head, x = c_{l,h}; the head's QR score is the mean over
  items of the gold passage's score (the reference's LME detection, `lme_eval`).
* Retrieval (`qr_retrieve`): x = sum_{(l,h) in S} c_{l,h} over the selected heads S (summed over
  heads first, then filtered), passages ranked by score (the reference's `score_docs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import encode_prompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSet
from heads.scorers.retrieval.request import DEFAULT_NULL_QUERY, QRHeadRequest

__all__ = [
    "DEFAULT_NULL_QUERY",
    "QrTokens",
    "passage_scores",
    "qr_prompt",
    "qr_retrieve",
    "qr_tokens",
    "qrhead_scores",
    "recall_at",
    "run_qrhead",
]

INSTRUCTION = "Here are some paragraphs:"
LATE_INSTRUCTION = "Please find information that are relevant to the following query in the paragraphs above."
"""The reference's `retrieval_instruction` / `retrieval_instruction_late` wording."""


def _check_texts(question: object, passages: object) -> tuple[str, list[str]]:
    if not isinstance(question, str) or not question.strip():
        raise HeadsteerValueError(f"question must be a non-empty string, got {short_repr(question)}")
    if isinstance(passages, (str, bytes)) or not isinstance(passages, Sequence) or len(passages) < 2:
        raise HeadsteerValueError(
            f"passages must be a list of at least 2 strings, got {short_repr(passages)}"
        )
    for p in passages:
        if not isinstance(p, str) or not p.strip():
            raise HeadsteerValueError(f"every passage must be a non-empty string, got {short_repr(p)}")
        if "**" in p or "**" in question:
            raise HeadsteerValueError(f"'**' is markup here; remove it from the texts: {short_repr(p[:40])}")
    return question, list(passages)


def qr_prompt(question: str, passages: Sequence[str]) -> str:
    """The scoring prompt with `**markup**`: one span per passage (`[i] text`), then one span from the
    late instruction through the query. Layout as the reference's `get_prompt`."""
    question, passages = _check_texts(question, passages)
    body = INSTRUCTION + "".join(f"\n\n**[{i + 1}] {p}**" for i, p in enumerate(passages))
    return body + f"\n\n**{LATE_INSTRUCTION}\n\nQuery: {question}**"


@dataclass
class QrTokens:
    """Calibrated per-token scores of one (question, passages) item.

    Attributes:
        scores: `[L, H, P0]` fp32, `s(query) - s(null)` on the common key columns P0.
        spans: per passage, its token range `(start, end)` (end exclusive) in those columns.
    """

    scores: torch.Tensor
    spans: list[tuple[int, int]]


def _query_attention(model: HeadModel, prompt: str, chat: bool | None) -> tuple[torch.Tensor, list]:
    """`[L, H, P]` mean attention of the query rows (query span start .. end of the prompt) on
    every key, and the spans (passages then query) of the single-row encoding."""
    enc = encode_prompts(model.tokenizer, [prompt], chat=chat)
    spans = list(enc.spans[0])
    q0, p_len = spans[-1][0], enc.length
    model.check_length(p_len)

    def mean_rows(probs: torch.Tensor, call: AttentionCall) -> tuple[torch.Tensor, int]:
        return probs[0][:, :, :p_len].sum(1).cpu(), call.q_len  # only the query rows arrive

    # only the query rows' pattern is computed (`[H, rows, P]` per layer, never `[H, P, P]`): memory
    # and time linear in the documents' length
    recs = [Recorder(layer=la, fn=mean_rows, query_range=(q0, p_len)) for la in range(model.n_layers)]
    with torch.no_grad(), editing(model, recs):
        model.run(**enc.model_inputs(model.device), use_cache=False, logits_to_keep=1)
    out = []
    for r in recs:
        tot = sum(x for x, _ in r.records)
        out.append(tot / sum(n for _, n in r.records))
    return torch.stack(out).float(), spans


def _check_budget(
    model: HeadModel,
    items: list[tuple[str, list[str], int]],
    null_query: str,
    chat: bool | None,
    opts: SweepOptions,
) -> None:
    """Refuse, before any prefill, a `max_memory` below the `"qrhead"` plan of the longest
    prompt with the most query rows (one prompt per forward: no batch to shrink)."""
    from heads.planning import MemoryRequest

    length = rows = 1
    for q, ps, _ in items:
        for question in (q, null_query):
            enc = encode_prompts(model.tokenizer, [qr_prompt(question, ps)], chat=chat)
            length, rows = max(length, enc.length), max(rows, enc.length - enc.spans[0][-1][0])
    opts.check_run(model, length, MemoryRequest("qrhead", {"query_rows": rows}))


def qr_tokens(
    model: HeadModel,
    question: str,
    passages: Sequence[str],
    *,
    null_query: str = DEFAULT_NULL_QUERY,
    chat: bool | None = None,
) -> QrTokens:
    """Two prefills (the query, then the null query) and the calibrated per-token scores.

    Raises:
        ValueError: an empty question / null query, fewer than 2 passages, an empty passage, or
            `**` in a text; the prompt longer than the model's position limit.
    """
    request = QRHeadRequest(null_query=null_query, chat=chat)  # its checks of null_query and chat
    return _qr_tokens(model, question, passages, request.null_query, request.chat)


def _qr_tokens(
    model: HeadModel, question: str, passages: Sequence[str], null_query: str, chat: bool | None
) -> QrTokens:
    """`qr_tokens` with `null_query` and `chat` already checked (by a `QRHeadRequest`)."""
    prompt, null = qr_prompt(question, passages), qr_prompt(null_query, passages)
    if model.tokenizer is None:
        raise HeadsteerTypeError("QRHead needs a model with a tokenizer")
    s_q, spans = _query_attention(model, prompt, chat)
    s_n, spans_n = _query_attention(model, null, chat)
    if spans[:-1] != spans_n[:-1] or spans[-1][0] != spans_n[-1][0]:
        raise HeadsteerValueError("the query and null-query prompts tokenize differently before the query")
    m = min(s_q.shape[-1], s_n.shape[-1])
    return QrTokens((s_q[..., :m] - s_n[..., :m]), [tuple(s) for s in spans[:-1]])


def passage_scores(x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`[..., n]` outlier-filtered sums of `x` `[..., P]` over each passage's tokens (module docstring)."""
    out = []
    for s, e in spans:
        seg = x[..., s:e]
        thr = seg.mean(-1, keepdim=True) - 2 * seg.std(-1, keepdim=True)
        out.append(seg.masked_fill(~(seg > thr), 0.0).sum(-1))
    return torch.stack(out, -1)


def _items(items: object) -> list[tuple[str, list[str], int]]:
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence) or not items:
        raise HeadsteerValueError(
            f"items must be a non-empty list of {{question, passages, gold}} dicts, got {short_repr(items)}"
        )
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, Mapping) or not {"question", "passages", "gold"} <= set(it):
            raise HeadsteerValueError(
                f"item {i} must be a dict with question, passages, gold; got {short_repr(it)}"
            )
        q, ps = _check_texts(it["question"], it["passages"])
        g = check_int(f"item {i} gold", it["gold"], lo=0, hi=len(ps) - 1)
        out.append((q, ps, g))
    return out


def qrhead_scores(
    model: HeadModel,
    items: Sequence[Mapping],
    *,
    null_query: str = DEFAULT_NULL_QUERY,
    chat: bool | None = None,
    tokens: Sequence[QrTokens] | None = None,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> HeadScores:
    """QR score of every head: the mean over `items` of the gold passage's calibrated score.

    Builds the `QRHeadRequest` (its checks) and runs it (`run_qrhead`, as `heads.run` does).

    Args:
        model: the model.
        items: dicts `{"question": str, "passages": [str, ...], "gold": int}` (gold = index of the
            relevant passage), e.g. `probes/data/retrieval/qrhead.jsonl`.
        null_query: the calibration query (default `"N/A"`).
        chat: apply the chat template (default: when the tokenizer has one).
        tokens: precomputed `qr_tokens` of the items, in order (skips the prefills).
        options: `heads.SweepOptions`; `progress`: a tqdm bar (default), False, or a
            `(done, total)` callable, per item; `max_memory`: refused before any prefill when the
            longest prompt's `"qrhead"` plan exceeds it (one prompt per forward).
        **deprecated: `progress=` as a keyword (one release; a `DeprecationWarning`).

    Returns:
        HeadScores `[L, H]`, method `"qrhead"` (higher = a better query-focused retrieval head).

    Raises:
        ValueError: a malformed item (checked for all items before any forward pass).

    Source: arXiv:2506.09944 §3 (QR score); reference `exp_scripts/detection/detect_qrhead_lme.py`
    (`lme_eval`, `score_heads`) and `AttnBasedRetriever.score_docs_per_head_for_detection`.
    """
    opts = sweep_options(options, deprecated, "qrhead_scores", takes=("progress", "max_memory"))
    request = QRHeadRequest(null_query=null_query, chat=chat)
    return run_qrhead(model, items, request, opts, tokens=tokens)


def run_qrhead(
    model: HeadModel,
    items: Sequence[Mapping],
    request: QRHeadRequest,
    options: SweepOptions | None = None,
    *,
    tokens: Sequence[QrTokens] | None = None,
) -> HeadScores:
    """Run a `QRHeadRequest` on `items` (what `qrhead_scores` does once it has built the request,
    whose values are checked there; `options` takes `progress` and `max_memory`; see `qrhead_scores` for the
    arguments, the result and the errors)."""
    if not isinstance(request, QRHeadRequest):
        raise HeadsteerTypeError(f"request must be a QRHeadRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "qrhead_scores", takes=("progress", "max_memory"))
    null_query, chat = request.null_query, request.chat
    checked = _items(items)
    if tokens is not None and len(tokens) != len(checked):
        raise HeadsteerValueError(f"tokens has {len(tokens)} entries for {len(checked)} items")
    if tokens is None and opts.max_memory is not None:
        _check_budget(model, checked, null_query, chat, opts)
    total = torch.zeros(model.n_layers, model.n_heads)
    with progress_callback(opts.progress, "qrhead", "items") as report:
        for k, (q, ps, g) in enumerate(checked):
            tok = _qr_tokens(model, q, ps, null_query, chat) if tokens is None else tokens[k]
            total += passage_scores(tok.scores, tok.spans)[..., g]
            if report is not None:
                report(k + 1, len(checked))
    return HeadScores(
        total / len(checked),
        method="qrhead",
        params={"n_items": len(checked), "null_query": null_query},
        model=model.name,
        n_kv_heads=model.n_kv_heads,
    )


def _head_index(model: HeadModel, heads: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    if heads is None:
        return None
    pairs = list(heads) if isinstance(heads, (HeadSet, list, tuple)) else None
    if not pairs:
        raise HeadsteerValueError(
            f"heads must be a non-empty HeadSet or list of (layer, head), got {short_repr(heads)}"
        )
    for la, h in pairs:
        model.check_head(la, h)
    return torch.tensor([la for la, _ in pairs]), torch.tensor([h for _, h in pairs])


def qr_retrieve(
    model: HeadModel,
    question: str,
    passages: Sequence[str],
    heads: HeadSet | Sequence[tuple[int, int]] | None,
    *,
    null_query: str = DEFAULT_NULL_QUERY,
    chat: bool | None = None,
    tokens: QrTokens | None = None,
) -> torch.Tensor:
    """`[n]` passage scores from the selected heads' calibrated attention (higher = more relevant).

    Args:
        heads: the retrieval heads S (e.g. `qrhead_scores(...).top(16)`, the reference's default
            size), or None for every head (the reference's `FullHeadRetriever`).
        tokens: precomputed `qr_tokens` of this item (skips the two prefills).

    Raises:
        ValueError: bad texts (see `qr_tokens`); empty heads or a head outside the model.

    Source: reference `AttnBasedRetriever.score_docs` (sum over the heads, then the 2-std filter).
    """
    idx = _head_index(model, heads)
    if tokens is None:
        tokens = qr_tokens(model, question, passages, null_query=null_query, chat=chat)
    c = tokens.scores
    x = c.sum((0, 1)) if idx is None else c[idx[0], idx[1]].sum(0)
    return passage_scores(x, tokens.spans)


def recall_at(scores: torch.Tensor, gold: int, k: int) -> float:
    """1.0 when `gold` is among the `k` best passages of `scores` `[n]` (ties: lower index first)."""
    order = sorted(range(scores.numel()), key=lambda i: (-float(scores[i]), i))
    return float(gold in order[:k])

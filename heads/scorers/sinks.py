"""Attention sinks: per-head column statistics and sink detection (Yu et al., ICML 2024, ACT;
docs/methods/act.md), and massive activations of the residual stream.

The sink score of key column j is the mean attention it receives from the real query rows
that can see it, a_j = (sum over i >= j of A_ij) / n_j. Column j is a sink when

* `rule="relative"` (default; the paper's rule per secondary sources): a_j > alpha_s / N,
  alpha_s = 5, N the number of real tokens of the prompt;
* `rule="absolute"` (reference code): a_j > theta, theta = 0.1.

The first real position is exempt (`exempt="position"`, default) — the initial sink is kept —
or, for reference parity, the first flagged column (`exempt="first_flagged"`). Pad columns are
never sinks; columns seen by fewer than `min_support` real rows are not flagged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import pandas as pd
import torch

from heads._util.validation import check_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError
from heads.inputs.prompts import encode_prompts, normalize_prompts
from heads.inputs.tokens import readable_tokens
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores
from heads.results.sinks import SCHEMA as SCHEMA
from heads.results.sinks import SCHEMA_VERSION as SCHEMA_VERSION
from heads.results.sinks import STATS as STATS
from heads.results.sinks import SinkStats as SinkStats  # defined there; imported here as before
from heads.scorers.sink_requests import SinkStatsRequest, check_sink_rule

if TYPE_CHECKING:  # pragma: no cover
    pass

__all__ = [
    "SinkRule",
    "SinkStats",
    "column_scores",
    "find_sinks",
    "massive_activations",
    "run_sink_stats",
    "sink_stats",
]


Rule = Literal["relative", "absolute"]
Exempt = Literal["position", "first_flagged"]


@dataclass(frozen=True)
class SinkRule:
    """How sinks are flagged from the column scores a_j (module docstring; defaults as in
    docs/methods/act.md, Yu et al. 2024).

    Attributes:
        rule: `"relative"` (default: a_j > alpha_s / N, N the prompt's real tokens) or
            `"absolute"` (the reference code's: a_j > theta).
        alpha_s: the relative rule's factor (default 5.0, > 0).
        theta: the absolute rule's threshold (default 0.1, > 0).
        exempt: `"position"` (default: the first real position is never a sink) or
            `"first_flagged"` (the first flagged column per head, for reference parity).
        min_support: a column seen by fewer real query rows is not flagged (default 1: every
            column). a_j of the last columns averages very few rows (the last one: its own
            row), so on long prompts the absolute rule flags the prompt's last tokens whenever
            they attend to themselves (the relative rule too: alpha_s / N is small);
            `min_support=32` reads only columns averaged over at least that many rows.

    Raises:
        HeadsteerValueError: an unknown rule / exempt, alpha_s or theta not > 0,
            min_support < 1.
    """

    rule: Rule = "relative"
    alpha_s: float = 5.0
    theta: float = 0.1
    exempt: Exempt = "position"
    min_support: int = 1

    def __post_init__(self) -> None:
        check_sink_rule(
            self.rule, self.alpha_s, self.theta, self.exempt, self.min_support
        )  # the request's checks


def column_scores(probs: torch.Tensor, key_real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sink scores a_j and supports n_j of a prefill pattern.

    Args:
        probs: `[B, H, T, T]` attention pattern (query rows x key columns, masked entries 0).
        key_real: `[B, T]` bool, the real (non-pad) positions.

    Returns:
        `a` `[B, H, T]` fp32 (0 where n_j = 0) and `n` `[B, T]` (real rows i >= j seeing column j).
    """
    real = key_real.to(probs.device)
    t = probs.shape[-1]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=probs.device))  # [i, j]: i >= j
    seen = causal[None] & real[:, :, None] & real[:, None, :]  # [B, i, j]
    n = seen.sum(1)  # [B, T]
    col = (probs.float() * seen[:, None]).sum(-2)  # [B, H, T]
    a = torch.where(n[:, None] > 0, col / n[:, None].clamp(min=1), 0.0)
    return a, n


def _column_support(key_real: torch.Tensor) -> torch.Tensor:
    """`[B, T]` n_j: the real rows i >= j that see column j (0 on pad columns), without a `[T, T]` mask."""
    real = key_real.long()
    after = real.flip(-1).cumsum(-1).flip(-1)  # real positions at or after j
    return after * real


def _column_sums(probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`[B, H, K]` column sums of a pattern block `probs` `[B, H, q, K]` over the rows weighted by
    `rows` `[B, q]` (1 on real rows, 0 on padding): one `[1, q] x [q, K]` product per (batch
    row, head), the block read once and never copied."""
    return torch.matmul(rows[:, None, None, :], probs.float())[:, :, 0]


def find_sinks(
    a: torch.Tensor, n: torch.Tensor, key_real: torch.Tensor, rule: SinkRule | SinkStatsRequest
) -> torch.Tensor:
    """`[B, H, T]` bool sink set S from column scores (`column_scores`), after the exemption."""
    real = key_real.to(a.device)
    n_tokens = real.sum(-1).float()[:, None, None]  # N per prompt
    thr = rule.alpha_s / n_tokens if rule.rule == "relative" else torch.full_like(n_tokens, rule.theta)
    flagged = (a > thr) & real[:, None] & (n >= rule.min_support)[:, None]
    if rule.exempt == "position":
        first = real.float().argmax(-1)  # first real position (left padding)
        flagged[torch.arange(a.shape[0]), :, first] = False
    else:
        has = flagged.any(-1)
        idx = flagged.float().argmax(-1)  # first flagged column per (b, h)
        b, h = torch.nonzero(has, as_tuple=True)
        flagged[b, h, idx[b, h]] = False
    return flagged


def _check_rule(rule: object) -> SinkRule:
    if rule is None:
        return SinkRule()
    if not isinstance(rule, SinkRule):
        raise HeadsteerTypeError(
            "rule must be a heads.scorers.sinks.SinkRule, e.g. SinkRule(rule='absolute'), got "
            f"{short_repr(rule)}"
        )
    return rule


def sink_stats(
    model: HeadModel,
    prompts: Sequence,
    *,
    rule: SinkRule | None = None,
    chat: bool | None = None,
    markup: bool = True,
) -> SinkStats:
    """Per (layer, head) sink statistics of the prompts' prefill patterns (docs/methods/act.md).

    Builds the `SinkStatsRequest` (the rule's fields, `chat`, `markup`: its checks) and runs it
    (`run_sink_stats`, as `heads.run` does).

    Args:
        prompts: a prompt or a list (strings or chats), encoded as `SteeredModel.generate`
            encodes them, so the statistics are of the token sequence that is steered.
        rule: how sinks are flagged (default `SinkRule()`: relative, alpha_s = 5).
        chat: apply the chat template (default: when the tokenizer has one, as `generate`).
        markup: strip `**…**` emphasis markup first (default True, as `generate`).

    Raises:
        ValueError: empty prompts, bad rule.
    """
    rule = _check_rule(rule)
    request = SinkStatsRequest(
        rule=rule.rule,
        alpha_s=rule.alpha_s,
        theta=rule.theta,
        exempt=rule.exempt,
        min_support=rule.min_support,
        chat=chat,
        markup=markup,
    )
    return run_sink_stats(model, prompts, request)


@torch.no_grad()
def run_sink_stats(
    model: HeadModel, prompts: Sequence, request: SinkStatsRequest, options: SweepOptions | None = None
) -> SinkStats:
    """Run a `SinkStatsRequest` on `prompts` (what `sink_stats` does once it has built the
    request, whose values are checked there; `options` takes `max_memory` only: one forward of
    every prompt, refused before it when its `"sinks"` plan exceeds the budget; see `sink_stats`
    for the rest)."""
    if not isinstance(request, SinkStatsRequest):
        raise HeadsteerTypeError(f"request must be a SinkStatsRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "sink_stats", takes=("max_memory",))
    rule = request  # its rule fields are a SinkRule's, checked by the same function
    chat, markup = request.chat, request.markup
    enc = encode_prompts(model.tokenizer, normalize_prompts(prompts)[0], chat=chat, markup=markup)
    opts.check_run(model, enc.length, "sinks", enc.batch)  # max_memory: one forward, not split
    real = enc.attention_mask.bool()
    first = real.float().argmax(-1)
    rows = torch.arange(enc.batch)
    out = {k: torch.zeros(model.n_layers, model.n_heads) for k in ("sink", "first", "n")}
    records = []

    # Column sums over the real query rows, reduced block by block inside the forward (the engine
    # hands a read-only layer's pattern over in query blocks, `heads.engine.state.read_block_rows`):
    # memory stays linear in the prompt, no [B, H, T, T] pattern is ever kept.
    n = _column_support(real)  # [B, T]
    colsum: dict[int, torch.Tensor] = {}

    def accumulate(probs: torch.Tensor, call: AttentionCall) -> None:
        w = real[:, call.q_offset : call.q_offset + call.q_len].to(probs.device, torch.float32)
        part = _column_sums(probs, w)[..., : real.shape[1]].cpu()
        colsum[call.layer] = part if call.layer not in colsum else colsum[call.layer] + part

    recs = [Recorder(layer=la, fn=accumulate) for la in range(model.n_layers)]
    with editing(model, recs):
        forward(model, enc, logits_to_keep=1)  # no full-vocabulary logits at every position
    tokens = [readable_tokens(model.tokenizer, r) for r in enc.input_ids]
    n_rows = real.sum(-1)[:, None].float()
    for la in range(model.n_layers):
        col = colsum[la] * real[:, None]  # [B, H, T]: real columns only
        a = torch.where(n[:, None] > 0, col / n[:, None].clamp(min=1), 0.0)
        s = find_sinks(a, n, real, rule)
        out["sink"][la] = ((col * s).sum(-1) / n_rows).mean(0)
        out["first"][la] = (col[rows, :, first] / n_rows).mean(0)
        out["n"][la] = s.sum(-1).float().mean(0)
        for b, h, j in torch.nonzero(s).tolist():
            records.append((b, la, h, j - int(first[b]), tokens[b][j], float(a[b, h, j])))
    params = {"rule": rule.rule, "alpha_s": rule.alpha_s, "theta": rule.theta, "exempt": rule.exempt}
    params["n_prompts"] = enc.batch

    def scores(t, method):
        return HeadScores(t, method, dict(params), model.name, model.n_kv_heads)

    cols = ["prompt", "layer", "head", "position", "token", "score"]
    return SinkStats(
        scores(out["sink"], "sink_mass"),
        scores(out["first"], "first_token_mass"),
        scores(out["n"], "n_sinks"),
        pd.DataFrame(records, columns=cols),
    )


@torch.no_grad()
def massive_activations(
    model: HeadModel,
    prompts: Sequence,
    *,
    top: int = 10,
    chat: bool | None = None,
    markup: bool = True,
) -> pd.DataFrame:
    """The largest-magnitude residual-stream activations (Sun et al. 2024, "massive activations").

    Returns a DataFrame `layer, prompt, position, token, dim, value, ratio_to_median` of the
    `top` largest |activation| entries of the residual stream entering each layer `0..L-1`
    (`layer = L` is the final normed state, as `transformers` reports it), over real tokens;
    `position` counts from the first real token; `token` is readable text (`heads.inputs.tokens`);
    `ratio_to_median` is |value| / the median |activation| of that layer.

    Prompts are encoded as `SteeredModel.generate` encodes them: the chat template when the
    tokenizer has one (`chat=None`) and `**…**` markup stripped (`markup=True`).

    Raises:
        ValueError: empty prompts, or `top` outside 1..(real tokens x d_model).
    """
    enc = encode_prompts(model.tokenizer, normalize_prompts(prompts)[0], chat=chat, markup=markup)
    real = enc.attention_mask.bool()
    n_real = int(real.sum()) * model.d_model
    check_int("top", top, lo=1, hi=n_real, what=f"an int in 1..{n_real} (real tokens x d_model)")
    out = forward(model, enc, output_hidden_states=True)
    first = real.float().argmax(-1)
    tokens = [readable_tokens(model.tokenizer, r) for r in enc.input_ids]
    rows = []
    for la, h in enumerate(out.hidden_states):
        mag = h.float().cpu().abs()
        med = mag[real].median().item()
        x = torch.where(real[..., None], mag, -1.0)  # padding never ranks
        vals, idx = x.flatten().topk(top)
        for v, i in zip(vals.tolist(), idx.tolist(), strict=True):
            b, rest = divmod(i, x.shape[1] * x.shape[2])
            p, d = divmod(rest, x.shape[2])
            sign = float(h[b, p, d])
            rows.append((la, b, p - int(first[b]), tokens[b][p], d, sign, v / max(med, 1e-30)))
    cols = ["layer", "prompt", "position", "token", "dim", "value", "ratio_to_median"]
    return pd.DataFrame(rows, columns=cols)

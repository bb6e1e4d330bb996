"""The in-context-learning score (Olsson et al. 2022, adapted to short contexts).

Olsson et al. define the ICL score as the loss at token 500 minus the loss at token 50 of
natural text: how much a model gains from what it has already read. A small model trained here
sees short contexts, so headsteer measures it on sequences built for it: `[BOS] + R + R`, R
being `m` distinct random non-special tokens (`heads.scorers.roles.detectors.repeated_tokens`).
A model that only knows unigram statistics predicts both copies equally badly; a model with
induction heads predicts the second copy from the first. So

    icl_score = mean NLL on the tokens of the second copy - mean NLL on the tokens of the first

(nats per token; negative when the model learns in context, about 0 before). The first token of
each copy is left out (nothing in the context predicts it).
"""

from __future__ import annotations

import torch

from heads._util.validation import check_int
from heads.engine.forward import forward
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel

__all__ = ["DEFAULT_ICL_LENGTH", "icl_score", "icl_sequences"]

DEFAULT_ICL_LENGTH = 50
"""Length m of the repeated segment by default (capped by the model's positions)."""


def icl_sequences(
    model: HeadModel, *, n: int = 16, length: int | None = None, seed: int = 0
) -> EncodedPrompts:
    """`n` rows `[BOS] + R + R` with `|R| = length` (default `DEFAULT_ICL_LENGTH`, or what fits in
    the model's positions), drawn with `seed` (`repeated_tokens`, so every row has one length).

    Raises:
        HeadsteerValueError: `n` or `length` not a positive int, rows longer than the context, a
            bad seed.
    """
    from heads.scorers.roles.detectors import repeated_tokens

    if length is None:
        limit = model.max_positions
        length = DEFAULT_ICL_LENGTH if limit is None else max(1, min(DEFAULT_ICL_LENGTH, (limit - 1) // 2))
    length = check_int("length", length, lo=2)
    return repeated_tokens(model, n_seqs=n, length=(length, length), seed=seed)


@torch.no_grad()
def icl_score(
    model: HeadModel,
    sequences: EncodedPrompts | None = None,
    *,
    n: int = 16,
    length: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """The in-context-learning score of `model` (see the module docstring).

    Args:
        model: the model.
        sequences: rows `[BOS] + R + R` of one length (default: `icl_sequences(model, n=n,
            length=length, seed=seed)`).
        n, length, seed: the default sequences' count, segment length and seed.

    Returns:
        `{"icl_score": second - first, "loss_first": ..., "loss_second": ...}` in nats per token.

    Raises:
        HeadsteerValueError: rows that are not of the form `[BOS?] + R + R` of one length; bad
            `n`, `length` or `seed`.
    """
    from heads.errors import HeadsteerValueError

    enc = icl_sequences(model, n=n, length=length, seed=seed) if sequences is None else sequences
    ids = enc.input_ids
    if not bool(enc.attention_mask.bool().all()):
        raise HeadsteerValueError("icl_score needs rows of one length (no padding)")
    t = ids.shape[1]
    m = t // 2
    start = t - 2 * m  # 1 with a BOS, 0 without
    if m < 2 or not torch.equal(ids[:, start : start + m], ids[:, start + m :]):
        raise HeadsteerValueError("icl_score needs rows [BOS] + R + R (a repeated segment R)")
    logits = forward(model, enc).float()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None].to(logits.device))[..., 0]
    # nll[:, p] is the loss of token p + 1; copy one holds tokens start .. start+m-1
    first = nll[:, start : start + m - 1].mean()  # tokens start+1 .. start+m-1
    second = nll[:, start + m : start + 2 * m - 1].mean()  # tokens start+m+1 .. end
    return {
        "icl_score": float(second - first),
        "loss_first": float(first),
        "loss_second": float(second),
    }

"""Steered generation on sliding-window layers: refused before the work when it would stop part-way.

An attention edit (a logit bias or a pattern edit, e.g. PASTA, SpotLight, InstABoost, ACT) on
a sliding-window layer cannot be placed once a decoding step's keys reach the window less one:
the layer's KV cache then no longer holds absolute positions, and the engine stops the run
(`heads.engine.kernels.common.check_window`). The prompt's prefill is never refused (its keys
are the prompt itself); decoding step `i` (1..N-1) of a run of `N` new tokens sees `T + i`
keys, so `T` prompt tokens and `N >= 2` new tokens fail exactly when `T + N >= window`.
`check_window_room` says so before any forward, naming the most new tokens that fit, so a
server never streams half an answer and then an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from heads.engine.edits import LogitBias, ProbEdit
from heads.errors import HeadsteerValueError

if TYPE_CHECKING:
    from heads.inputs.prompts import EncodedPrompts
    from heads.model.adapter import HeadModel

__all__ = ["check_window_room"]


def check_window_room(
    model: HeadModel, enc: EncodedPrompts, steer: Sequence[Any], new_tokens: int, name: str = "max_new_tokens"
) -> None:
    """Refuse a generation of `new_tokens` on the `enc` prompt (`T = enc.length` tokens) whose
    steering puts an attention edit on a sliding-window layer the decoding would reach.

    Args:
        model: the `HeadModel` (`HeadModel.sliding_window(layer)` gives each layer's window).
        enc: the encoded prompt (one row; its length is the row's, not a batch's).
        steer: the interventions (each with `.edits(model, enc)`).
        new_tokens: the most tokens the run may generate.
        name: the request field named in the message (`max_new_tokens`, the server's `max_tokens`).

    Raises:
        HeadsteerValueError: `T + new_tokens >= window` for a layer that carries an attention edit
            and `new_tokens >= 2`; the message names the layer, its window and the most new
            tokens that fit.
    """
    if new_tokens < 2:
        return
    t = enc.length
    for e in (e for s in steer for e in s.edits(model, enc)):
        window = model.sliding_window(e.layer) if isinstance(e, (LogitBias, ProbEdit)) else None
        if window is not None and t + new_tokens >= window:
            room = max(window - t - 1, 1)
            raise HeadsteerValueError(
                f"{name}={new_tokens}: layer {e.layer} uses sliding-window attention (window {window}) and "
                f"the prompt's {t} tokens plus {new_tokens} new ones reach it; its attention edits cannot be "
                f"placed past that (at most {room} new tokens here, or a shorter prompt)"
            )

"""Head ablation during generation (docs/methods/ablation.md).

`Ablate(heads, method="ua")` turns into engine edits for `SteeredModel.generate`: every
chosen head is ablated at every position, prompt rows and each decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from heads._util.validation import check_number, short_repr
from heads.engine.edits import Edit, HeadScale, QueryScale, max_factor
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet, HeadSpec
from steer.noop import empty_heads, warn_noop

__all__ = ["Ablate"]


@dataclass(frozen=True)
class Ablate:
    """Ablate attention heads while generating.

    Args:
        heads: a `heads.HeadSpec`: a `{"layer": [heads]}` dict, list of `(layer, head)`
            pairs, list of layers, `HeadSet` or JSON file (as `Pasta`).
        method: `"ua"` (query slice x eps: uniform attention, the paper's main operator,
            default), `"sc"` (head output x eps: zero ablation as eps -> 0).
        eps: the scale (default 0, exact); 1 is a no-op. |eps| is bounded by the model's
            dtype when applied (`heads.engine.edits.max_factor`): 255 in float16, 1e4 in
            bfloat16 and float32; beyond it the scaled activations overflow.

    Raises:
        ValueError: unknown method, a non-finite eps; when applied: unknown heads, or |eps|
            above the bound of the model's dtype (naming the value and the dtype).

    Source: Zhou et al., ICLR 2025 (arXiv:2410.13708), §3.1.
    """

    heads: HeadSpec
    method: Literal["ua", "sc"] = "ua"
    eps: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in ("ua", "sc"):
            raise HeadsteerValueError(f"unknown ablation method {short_repr(self.method)}: use 'ua' or 'sc'")
        check_number("eps", self.eps)
        if self.eps == 1:
            warn_noop(f"Ablate eps={self.eps} is a no-op: output equals the unsteered model", stacklevel=4)
        if empty_heads(self.heads):
            warn_noop("Ablate with no heads ablates nothing: output equals the unsteered model", stacklevel=4)

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[Edit]:
        """One edit per layer with ablated heads (all batch rows).

        Raises:
            ValueError: |eps| above `max_factor(model.dtype)`, or unknown heads.
        """
        bound = max_factor(model.dtype)
        if abs(self.eps) > bound:
            dtype = str(model.dtype).replace("torch.", "")
            raise HeadsteerValueError(
                f"Ablate eps={self.eps:g} overflows {dtype}: |eps| must be <= {bound:g} in {dtype} "
                f"(1e4 in bfloat16 / float32)"
            )
        kind = QueryScale if self.method == "ua" else HeadScale
        heads = HeadSet.parse(self.heads, model.n_layers, model.n_heads)
        return [kind(layer=la, heads=hs, factor=float(self.eps)) for la, hs in heads.by_layer().items()]

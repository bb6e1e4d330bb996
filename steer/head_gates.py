"""Learned head gates as a steering intervention (Causal Head Gating, docs/methods/head_gating.md).

`HeadGates(gates)` scales every head's output `z` (its slice of the `o_proj` input) by its gate at
every position, prompt rows and each decode step, through the engine's `head_output` site
(`heads.scorers.gating.HeadGate`). Under GQA a gate is per query head.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from heads._util.validation import is_number, short_repr
from heads.engine.edits import Edit, max_factor
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores
from heads.scorers.gating.chg import GatingResult, HeadGate
from steer.noop import warn_noop

__all__ = ["HeadGates"]


@dataclass(frozen=True, eq=False)
class HeadGates:
    """Scale heads' outputs by per-head gates while generating.

    Args:
        gates: a `GatingResult` (its `remove` gates, G-, by default: see `which`), a `HeadScores`
            `[L, H]` of gates (e.g. `result.retain`), or an `[L, H]` tensor. NaN = no gate (1).
        which: for a `GatingResult`: `"remove"` (G-, default), `"retain"` (G+) or `"gates"` (G).
        binary: round the gates at `threshold` to 0 / 1 (a hard mask: the paper's ablation of
            the heads below it); default False (soft gates).
        threshold: the rounding threshold with `binary` (default 0.5).

    Raises:
        TypeError: `gates` of another type. ValueError: non-finite gates; when applied, gates of
            another shape than the model's `[n_layers, n_heads]` or |gate| above the bound of its
            dtype (`heads.engine.edits.max_factor`).
    """

    gates: GatingResult | HeadScores | torch.Tensor
    which: str = "remove"
    binary: bool = False
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.which not in ("remove", "retain", "gates"):
            raise HeadsteerValueError(
                f"which must be 'remove', 'retain' or 'gates', got {short_repr(self.which)}"
            )
        if not isinstance(self.binary, bool):
            raise HeadsteerTypeError(f"binary must be True or False, got {short_repr(self.binary)}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, numbers.Real):
            raise HeadsteerTypeError(
                f"threshold must be a number in (0, 1), got {short_repr(self.threshold)}"
            )
        if not is_number(self.threshold) or not 0.0 < float(self.threshold) < 1.0:  # NaN fails too
            raise HeadsteerValueError(f"threshold must be in (0, 1), got {short_repr(self.threshold)}")
        g = self.values()
        if bool(torch.isinf(g).any()):
            raise HeadsteerValueError("HeadGates: gates must be finite (NaN = no gate)")
        if bool((torch.nan_to_num(g, nan=1.0) == 1).all()):
            warn_noop(
                "HeadGates with every gate 1 is a no-op: output equals the unsteered model", stacklevel=4
            )

    def values(self) -> torch.Tensor:
        """`[L, H]` fp32 gates (NaN kept), rounded when `binary`."""
        g = self.gates
        if isinstance(g, GatingResult):
            g = getattr(g, self.which)
        if isinstance(g, HeadScores):
            t = g.scores
        elif isinstance(g, torch.Tensor):
            t = g.detach().float().cpu()
        else:
            raise HeadsteerTypeError(
                f"gates must be a GatingResult, HeadScores or [L, H] tensor, got {type(g).__name__}"
            )
        if t.ndim != 2:
            raise HeadsteerValueError(f"gates must be [L, H], got shape {tuple(t.shape)}")
        if self.binary:
            t = torch.where(torch.isnan(t), t, (t >= self.threshold).float())
        return t

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[Edit]:
        """One `HeadGate` per layer with a gate other than 1."""
        g = torch.nan_to_num(self.values(), nan=1.0)
        if tuple(g.shape) != (model.n_layers, model.n_heads):
            raise HeadsteerValueError(
                f"gates are {tuple(g.shape)}, the model has [{model.n_layers}, {model.n_heads}] heads"
            )
        bound = max_factor(model.dtype)
        if float(g.abs().max()) > bound:
            raise HeadsteerValueError(f"a gate above {bound:g} overflows {model.dtype}")
        return [
            HeadGate(layer=la, gate=g[la].clone()) for la in range(model.n_layers) if bool((g[la] != 1).any())
        ]

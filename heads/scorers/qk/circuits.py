"""A circuit's query and key edges, read through QK attribution.

An EAP / EAP-IG edge `u -> a{l}.h{h}<q>` says that corrupting node u's contribution to head h's
query moves the metric; `circuit_qk` says what that contribution *does* in the head's logits:
node u's query-side marginal (`scale * a_u(q) . k(k)`) at the key the head attends to most, and
averaged over the keys. A key edge `u -> a{l}.g{g}<k>` (the KV head g, shared by its group under
GQA) is read from u's key-side marginal for every query head of the group that the circuit
holds. One `qk_attribution` per head (one forward each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, Prompt
from heads.model.adapter import HeadModel
from heads.results.qk import QKAttribution
from heads.scorers.circuits.circuit import Circuit
from heads.scorers.patching.pairs import PairBatch
from heads.scorers.qk.attribution import qk_attribution
from heads.scorers.qk.family import check_qk_model

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["CircuitQK", "circuit_qk"]


@dataclass
class CircuitQK:
    """QK attribution of a circuit's q / k edges.

    Attributes:
        rows: one dict per (edge, query head): `edge`, `head` (`"L{l}H{h}"`), `side` (`"query"`
            or `"key"`), `component` (the upstream node's component name(s)), `edge_score`
            (the circuit's score), `at_top_key` (the node's marginal at each prompt's
            most-attended key, mean over prompts, logit units), `mean_abs` (mean |marginal| over
            every (query, key) cell), `top_key` (the most-attended key's token, prompt 0).
        attributions: `{(layer, head): QKAttribution}` of every head read.
    """

    rows: list[dict] = field(default_factory=list)
    attributions: dict[tuple[int, int], QKAttribution] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        """The rows as a table, by decreasing |at_top_key|."""
        import pandas as pd

        df = pd.DataFrame(
            self.rows,
            columns=["edge", "head", "side", "component", "edge_score", "at_top_key", "mean_abs", "top_key"],
        )
        return df.sort_values("at_top_key", key=lambda s: -s.abs(), kind="stable").reset_index(drop=True)


def _components(node: str, names: list[str]) -> list[int]:
    """Indices in a `QKAttribution`'s names of a graph node (`input`, `a{l}.h{h}`, `m{l}`)."""
    if node == "input":
        return [names.index(n) for n in ("embed", "pos_embed") if n in names]
    if node.startswith("a"):
        la, h = node[1:].split(".h")
        return [names.index(f"L{la}H{h}")]
    return [names.index(f"{node[1:]}_mlp_out")]


def _prompts(prompts: object) -> object:
    """A `PairBatch`'s clean rows as `EncodedPrompts`; anything else as given."""
    if isinstance(prompts, PairBatch):
        ids, mask = prompts.clean_ids, prompts.attention_mask
        n = ids.shape[0]
        return EncodedPrompts(
            ids, mask, [[] for _ in range(n)], ["" for _ in range(n)], [[] for _ in range(n)]
        )
    return prompts


@torch.no_grad()
def circuit_qk(
    model: HeadModel,
    circuit: Circuit,
    prompts: PairBatch | Prompt | Sequence[Prompt] | EncodedPrompts | torch.Tensor,
    *,
    query: int | Sequence[int] = -1,
    max_heads: int | None = None,
) -> CircuitQK:
    """QK attribution of every query and key edge of `circuit` (module docstring).

    Args:
        model: the model the circuit was found on (an accepted family, see `qk_attribution`).
        circuit: a `Circuit` (`find_circuit`, `select`).
        prompts: the pairs it was found on (their clean rows are read), or any prompts
            `qk_attribution` takes.
        query: query position(s) (default -1: the last token, where the metric is read).
        max_heads: read at most this many heads, those with the largest summed |edge score| on
            their q / k edges (default None: every head with such an edge).

    Returns:
        a `CircuitQK` (`to_frame()`: edge, head, side, component, edge score, marginal at the
        most-attended key, mean |marginal|).

    Raises:
        TypeError: `circuit` is not a `Circuit`.
        ValueError: a circuit found on another geometry, a refused family, bad prompts or
            positions (before any forward), `max_heads` < 1.
    """
    if not isinstance(circuit, Circuit):
        raise HeadsteerTypeError(f"circuit must be a Circuit, got {short_repr(circuit)}")
    check_qk_model(model)
    g = circuit.graph
    g.check_model(model)
    if max_heads is not None and (
        isinstance(max_heads, bool) or not isinstance(max_heads, int) or max_heads < 1
    ):
        raise HeadsteerValueError(f"max_heads must be a positive int or None, got {short_repr(max_heads)}")
    H, G = g.n_heads, g.n_kv_heads
    grp = H // G
    up, down = g.upstream_names(), g.downstream_names()
    # (layer, head) -> [(upstream node, side, edge name, score)]
    todo: dict[tuple[int, int], list[tuple[str, str, str, float]]] = {}
    for u, v in circuit.edges.tolist():
        la, r = divmod(v, g.per_layer)
        if la >= g.n_layers:
            continue  # the logits
        score = float(circuit.scores[u, v])
        name = f"{up[u]}->{down[v]}"
        if r < H:
            todo.setdefault((la, r), []).append((up[u], "query", name, score))
        elif r < H + G:
            for h in range((r - H) * grp, (r - H + 1) * grp):
                todo.setdefault((la, h), []).append((up[u], "key", name, score))
    heads = sorted(todo, key=lambda k: -sum(abs(s) for *_, s in todo[k]))
    if max_heads is not None:
        heads = heads[:max_heads]
    out = CircuitQK()
    data = _prompts(prompts)
    for la, h in sorted(heads):
        r = qk_attribution(model, data, (la, h), query=query)  # type: ignore[arg-type]
        out.attributions[(la, h)] = r
        valid = r.valid
        pat = torch.where(valid, r.pattern.nan_to_num(-1.0), -1.0)
        top = pat.argmax(-1)  # [N, Q] the most-attended key index
        marg = {"query": r.query_marginals(), "key": r.key_marginals()}
        tok = r.tokens[0][int(r.keys[0, int(top[0, 0])])] if r.tokens else ""
        for node, side, name, score in todo[(la, h)]:
            idx = _components(node, r.names)
            m = marg[side][..., idx].sum(-1)  # [N, Q, K]
            at = m.gather(-1, top[..., None])[..., 0]
            out.rows.append(
                {
                    "edge": name,
                    "head": f"L{la}H{h}",
                    "side": side,
                    "component": "+".join(r.names[i] for i in idx),
                    "edge_score": score,
                    "at_top_key": float(at.mean()),
                    "mean_abs": float(m[valid].abs().mean()),
                    "top_key": tok,
                }
            )
    return out

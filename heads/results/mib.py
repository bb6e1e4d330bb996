"""MIB's circuit-track file format in and out (Mueller et al. 2025; `hannamw/MIB-circuit-track`):
the JSON of importance scores for every edge, or the nine binary circuits of a submission
(`write_mib`, `read_mib`; `Circuit.to_mib` / `Circuit.from_mib` are the user's entry points), and
MIB's top-n selection and pruning (`mib_top`).

The conventions at the border (the sign: MIB's importance is minus headsteer's edge score; GQA:
a KV edge is one MIB edge per query head of its group, each with its share of the score) and
MIB's faithfulness curve (`mib_curve`, which runs the model) are in
`heads.scorers.circuits.mib`, which imports these names from here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from heads._util.files import check_output, write_text
from heads._util.validation import check_bool, check_int, is_number, read_json_file, short_repr
from heads.errors import HeadsteerValueError
from heads.results.graph import Graph
from heads.results.storage import json_text

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel

__all__ = ["MIB_PERCENTAGES", "SUBMISSION_SIZES", "mib_edge_names", "mib_top", "read_mib", "write_mib"]

MIB_PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""The edge fractions of MIB's faithfulness curve (`evaluate_area_under_curve`)."""
SUBMISSION_SIZES = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
"""The nine binary circuits of a MIB submission, in % of the edges (each holds at most this many)."""


# ------------------------------------------------------------------------------ names
def mib_edge_names(graph: Graph) -> list[tuple[str, int, int, float]]:
    """MIB's edges of `graph`: `(name, u, v, share)` with `(u, v)` headsteer's edge and `share`
    the part of its score the MIB edge carries (1, or 1 / group size for a KV edge under GQA)."""
    H, G = graph.n_heads, graph.n_kv_heads
    grp = H // G
    up = graph.upstream_names()
    out: list[tuple[str, int, int, float]] = []
    for la in range(graph.n_layers):
        first = 1 + la * (H + 1)  # upstream nodes before layer la
        for letter in "qkv":
            for h in range(H):
                if letter == "q":
                    d, share = graph.q_input(la, h), 1.0
                elif letter == "k":
                    d, share = graph.k_input(la, h // grp), 1.0 / grp
                else:
                    d, share = graph.v_input(la, h // grp), 1.0 / grp
                out += [(f"{up[u]}->a{la}.h{h}<{letter}>", u, d, share) for u in range(first)]
        d = graph.mlp_input(la)
        out += [(f"{up[u]}->m{la}", u, d, 1.0) for u in range(first + H)]
    d = graph.logits_input
    out += [(f"{up[u]}->logits", u, d, 1.0) for u in range(graph.n_upstream)]
    return out


def _node_in_graph(graph: Graph, mask: torch.Tensor) -> dict[str, bool]:
    """MIB's `nodes_in_graph` of a pruned circuit: a node with an edge out and one in (input: out)."""
    d2n = graph.down_to_node()  # [Dn, U + 1]
    has_in = (mask.any(0)[:, None] & d2n).any(0)[: graph.n_upstream]
    has_in[0] = True
    keep = mask.any(1) & has_in
    names = graph.upstream_names()
    return {**{n: bool(k) for n, k in zip(names, keep.tolist(), strict=True)}, "logits": True}


# ------------------------------------------------------------------------------ out
def _mib_dict(graph: Graph, scores: torch.Tensor, mask: torch.Tensor, d_model: int) -> dict:
    edges = {}
    for name, u, d, share in mib_edge_names(graph):
        s = float(scores[u, d])
        edges[name] = {"score": 0.0 if math.isnan(s) else -s * share, "in_graph": bool(mask[u, d])}
    cfg = {
        "n_layers": graph.n_layers,
        "n_heads": graph.n_heads,
        "parallel_attn_mlp": False,
        "d_model": d_model,
    }
    return {
        "cfg": cfg,
        "nodes": {n: {"in_graph": v} for n, v in _node_in_graph(graph, mask).items()},
        "edges": edges,
    }


def write_mib(
    graph: Graph,
    scores: torch.Tensor,
    mask: torch.Tensor,
    path: str | os.PathLike,
    *,
    d_model: int,
    binary: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """Write a circuit (`graph`, `scores` `[U, Dn]`, edge `mask` `[U, Dn]`) in MIB's format;
    returns the paths written. `Circuit.to_mib` is the user's entry point.

    Args:
        path: `binary=False` (default): the JSON file of importance scores for every edge
            (`in_graph` = the circuit's edges), e.g. `<folder>/importances.json` as MIB's
            `run_attribution.py` names it. `binary=True`: a folder for the nine binary circuits
            `edges_<size>.json` (`SUBMISSION_SIZES`: the top `int(size% x E)` edges by |score|,
            pruned as MIB prunes; scores written too, MIB's loader reads them).
        d_model: the model's width (MIB's `cfg`).
        overwrite: replace existing files.

    Raises:
        ValueError: a bad d_model; a file that exists without overwrite, a symlink; a path that
            is a folder (importances) or a file (binary).
    """
    check_bool("binary", binary)
    check_bool("overwrite", overwrite)
    width = check_int("d_model", d_model, lo=1, what="a positive int (MIB's cfg needs the model width)")
    if not binary:
        out = check_output(path, overwrite)
        text = json_text(_mib_dict(graph, scores, mask, width))
        return [write_text(out, text, overwrite=overwrite)]
    folder = Path(path).expanduser()
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise HeadsteerValueError(f"binary=True writes a folder of nine circuits; {str(folder)!r} is a file")
    targets = [folder / f"edges_{size:g}.json" for size in SUBMISSION_SIZES]
    for t in targets:
        check_output(t, overwrite)
    folder.mkdir(parents=True, exist_ok=True)
    n_items = len(mib_edge_names(graph))
    written = []
    for size, t in zip(SUBMISSION_SIZES, targets, strict=True):
        top = mib_top(graph, scores, int(size / 100 * n_items), absolute=True)
        written.append(write_text(t, json_text(_mib_dict(graph, scores, top, width)), overwrite=overwrite))
    return written


# ------------------------------------------------------------------------------ in
def read_mib(
    path: str | os.PathLike, model: HeadModel | None = None
) -> tuple[Graph, torch.Tensor, torch.Tensor, int]:
    """`(graph, scores [U, Dn], in_graph mask [U, Dn], d_model)` of a MIB circuit JSON (importance
    scores or a binary circuit); `scores` in headsteer's sign (-importance), NaN off the graph.
    `Circuit.from_mib` is the user's entry point.

    Args:
        model: checks the geometry and gives the KV heads (GQA); without it the graph has as
            many KV heads as query heads.

    Raises:
        ValueError: a missing or malformed file (not JSON, missing `cfg` / `nodes` / `edges`, a
            parallel attention + MLP cfg, an unknown or missing edge name, a score that is not a
            number), or a model of another geometry.
    """
    where = os.fspath(path)
    if not os.path.isfile(path):
        raise HeadsteerValueError(f"MIB circuit file {where!r} does not exist")
    d = read_json_file(path)
    if not isinstance(d, dict) or not all(k in d for k in ("cfg", "nodes", "edges")):
        raise HeadsteerValueError(f"{where!r}: not a MIB circuit (needs the keys cfg, nodes, edges)")
    cfg, edges = d["cfg"], d["edges"]
    if not isinstance(cfg, dict) or not isinstance(edges, dict):
        raise HeadsteerValueError(f"{where!r}: cfg and edges must be objects")
    n_layers = check_int(f"{where}: cfg.n_layers", cfg.get("n_layers"), lo=1, hi=1024)
    n_heads = check_int(f"{where}: cfg.n_heads", cfg.get("n_heads"), lo=1, hi=1024)
    d_model = check_int(f"{where}: cfg.d_model", cfg.get("d_model"), lo=1)
    if cfg.get("parallel_attn_mlp"):
        raise HeadsteerValueError(f"{where!r}: parallel attention + MLP graphs are not supported")
    n_kv, name = n_heads, ""
    if model is not None:
        if (model.n_layers, model.n_heads) != (n_layers, n_heads):
            raise HeadsteerValueError(
                f"{where!r} is a circuit of {n_layers} layers x {n_heads} heads, the model has "
                f"{model.n_layers} x {model.n_heads}"
            )
        n_kv, name = model.n_kv_heads, model.name
    graph = Graph(n_layers, n_heads, n_kv, name)
    names = mib_edge_names(graph)
    known = {n for n, *_ in names}
    missing = [n for n in known if n not in edges]
    extra = [n for n in edges if n not in known]
    if missing or extra:
        bad = sorted(missing)[0] if missing else extra[0]
        raise HeadsteerValueError(
            f"{where!r}: {len(edges)} edges, this graph has {len(names)} ({short_repr(bad)} "
            f"{'is missing' if missing else 'is not an edge'})"
        )
    scores = torch.zeros(graph.n_upstream, graph.n_downstream, dtype=torch.float64)
    mask = torch.zeros(graph.n_upstream, graph.n_downstream, dtype=torch.bool)
    for n, u, v, _ in names:
        e = edges[n]
        score = e.get("score", 0.0) if isinstance(e, dict) else None
        if not is_number(score) or not isinstance(e.get("in_graph"), bool):
            raise HeadsteerValueError(
                f"{where!r}: edge {short_repr(n)} needs a number score and a bool in_graph"
            )
        scores[u, v] -= float(score)
        mask[u, v] |= e["in_graph"]
    return graph, scores.float().masked_fill(~graph.valid, float("nan")), mask, d_model


# ------------------------------------------------------------------------------ MIB's curve
def _mib_prune(graph: Graph, mask: torch.Tensor) -> torch.Tensor:
    """MIB's `Graph.prune` on headsteer's layout: repeatedly drop edges whose source has no
    incoming edge (the input always has one) or whose target node has no outgoing edge (the
    logits always have one)."""
    d2n = graph.down_to_node()  # [Dn, U + 1]
    m = mask & graph.valid
    while True:
        has_in = (m.any(0)[:, None] & d2n).any(0)[: graph.n_upstream]
        has_in[0] = True
        node = m.any(1) & has_in  # MIB's nodes_in_graph
        target = (node[None, :].float() @ d2n[:, : graph.n_upstream].T.float()).bool()[0]
        target[graph.logits_input] = True
        new = m & node[:, None] & target[None, :]
        if torch.equal(new, m):
            return new
        m = new


def mib_top(graph: Graph, scores: torch.Tensor, n: int, *, absolute: bool = True) -> torch.Tensor:
    """`[U, Dn]` bool: MIB's `apply_topn(n, absolute)` then `prune()`: the `n` highest edges by
    score (|score| with `absolute`), ties by graph order, pruned (`_mib_prune`)."""
    e = torch.nonzero(graph.valid)
    v = scores[e[:, 0], e[:, 1]]
    key = torch.nan_to_num(v.abs() if absolute else v, nan=-math.inf)
    top = e[torch.argsort(key, descending=True, stable=True)[:n]]
    m = torch.zeros(graph.n_upstream, graph.n_downstream, dtype=torch.bool)
    m[top[:, 0], top[:, 1]] = True
    return _mib_prune(graph, m)

"""MIB's circuit-track evaluation, re-implemented here as a test oracle (never product code).

The lines re-implemented, cited by repository, path and commit:

* `hannamw/EAP-IG` @ 795f5607b25638935aec89aee3c1cb4bd9ed72f1, `src/eap/graph.py`:
  `Graph.from_model` (forward / backward indices, `forward_to_backward`, the edges and their
  names `"u->a{l}.h{h}<q>"`), `apply_topn` at edge level, `prune`, `to_json` / `from_json`.
* same commit, `src/eap/evaluate.py`: `evaluate_graph` with `intervention="patching"`: each
  downstream input gets `sum_{u not in graph} (a_u(corrupted) - a_u(this run))` added, every
  attention head's q / k / v input separately (`hook_{q,k,v}_input`), the MLP input and the
  logits input (`blocks.{L-1}.hook_resid_post`).
* `hannamw/MIB-circuit-track` @ b759df34433c9e31043ba9e02908ce0bf20e894f,
  `MIB_circuit_track/evaluation.py`: `evaluate_area_under_curve` (percentages, `int(pct * E)`,
  the faithfulness normalisation against the empty graph, the trapezoids).

The forward is a plain eager Llama (RMSNorm, RoPE, no GQA, SwiGLU; TransformerLens computes
the same per-head inputs with `use_split_qkv_input`), written from the architecture, so it is
independent of headsteer's decomposition.
"""

from __future__ import annotations

import json
import math

import torch

from tests.support.oracle import _rms, _rope

PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)


class MibGraph:
    """`eap.graph.Graph` at edge level, non-parallel blocks."""

    def __init__(self, n_layers: int, n_heads: int, d_model: int):
        self.cfg = {"n_layers": n_layers, "n_heads": n_heads, "parallel_attn_mlp": False, "d_model": d_model}
        L, H = n_layers, n_heads
        self.n_forward = 1 + L * (H + 1)
        self.n_backward = L * (3 * H + 1) + 1
        self.forward_to_backward = torch.zeros(self.n_forward, self.n_backward, dtype=torch.bool)
        self.real_edge_mask = torch.zeros(self.n_forward, self.n_backward, dtype=torch.bool)
        self.scores = torch.zeros(self.n_forward, self.n_backward)
        self.in_graph = torch.zeros(self.n_forward, self.n_backward, dtype=torch.bool)
        self.nodes_in_graph = torch.zeros(self.n_forward, dtype=torch.bool)
        self.edges: dict[str, tuple[int, int]] = {}
        stream = ["input"]
        for la in range(L):
            heads = [f"a{la}.h{h}" for h in range(H)]
            for h in range(H):
                for q in "qkv":
                    self.forward_to_backward[self.fwd(heads[h]), self.bwd(heads[h], q)] = True
            self.forward_to_backward[self.fwd(f"m{la}"), self.bwd(f"m{la}")] = True
            for node in stream:
                for h in range(H):
                    for q in "qkv":
                        self._add(node, heads[h], q)
            stream += heads
            for node in stream:
                self._add(node, f"m{la}")
            stream.append(f"m{la}")
        for node in stream:
            self._add(node, "logits")

    def fwd(self, name: str) -> int:
        H = self.cfg["n_heads"]
        if name == "input":
            return 0
        if name[0] == "m":
            return 1 + int(name[1:]) * (H + 1) + H
        layer, head = name.split(".")
        return 1 + int(layer[1:]) * (H + 1) + int(head[1:])

    def bwd(self, name: str, qkv: str | None = None) -> int:
        H = self.cfg["n_heads"]
        if name == "logits":
            return self.n_backward - 1
        if name[0] == "m":
            return int(name[1:]) * (3 * H + 1) + 3 * H
        layer, head = name.split(".")
        return int(layer[1:]) * (3 * H + 1) + "qkv".index(qkv) * H + int(head[1:])

    def _add(self, parent: str, child: str, qkv: str | None = None) -> None:
        name = f"{parent}->{child}" if qkv is None else f"{parent}->{child}<{qkv}>"
        idx = (self.fwd(parent), self.bwd(child, qkv))
        self.real_edge_mask[idx] = True
        self.edges[name] = idx

    # ---------------------------------------------------------------- selection
    def apply_topn(self, n: int, absolute: bool) -> None:
        self.nodes_in_graph[:] = False
        self.in_graph[:] = False
        s = self.scores.clone()
        if absolute:
            s = s.abs()
        s[~self.real_edge_mask] = -math.inf
        order = torch.argsort(s.view(-1), descending=True)
        self.in_graph.view(-1)[order[:n]] = True
        self.in_graph.view(-1)[order[n:]] = False
        out = self.in_graph.any(1)
        inn = (self.in_graph.any(0).float() @ self.forward_to_backward.float().T) > 0
        inn[0] = True
        self.nodes_in_graph |= out & inn
        self.prune()

    def prune(self) -> None:
        while True:
            out = self.in_graph.any(1)
            inn = (self.in_graph.any(0).float() @ self.forward_to_backward.float().T) > 0
            inn[0] = True
            old_nodes = self.nodes_in_graph.clone()
            self.nodes_in_graph[:] = out & inn
            fwd_in = self.nodes_in_graph.float()
            bwd_in = self.nodes_in_graph.float() @ self.forward_to_backward.float()
            bwd_in[-1] = 1
            old_edges = self.in_graph.clone()
            self.in_graph &= (fwd_in[:, None] * bwd_in[None, :]) > 0
            if torch.equal(old_nodes, self.nodes_in_graph) and torch.equal(old_edges, self.in_graph):
                return

    # ---------------------------------------------------------------- files
    @classmethod
    def from_json(cls, path) -> MibGraph:
        d = json.loads(open(path).read())
        assert all(k in d for k in ("cfg", "nodes", "edges"))
        g = cls(d["cfg"]["n_layers"], d["cfg"]["n_heads"], d["cfg"]["d_model"])
        for name, info in d["edges"].items():
            g.scores[g.edges[name]] = info["score"]
            g.in_graph[g.edges[name]] = info["in_graph"]
        for name, info in d["nodes"].items():
            if name != "logits":
                g.nodes_in_graph[g.fwd(name)] = info["in_graph"]
        return g


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def _run(model, ids: torch.Tensor, in_graph: torch.Tensor | None, corrupted: torch.Tensor | None):
    """A plain Llama forward that records every node's output `[F, B, T, D]`; with `in_graph`
    and the corrupted run's outputs, each input gets the corrupted outputs of the edges not in
    the graph (MIB's `input_construction_hook`). Returns (last-position logits, outputs)."""
    cfg = model.config
    inner = model.model
    B, T = ids.shape
    H, d = cfg.num_attention_heads, cfg.head_dim
    pos = torch.arange(T)[None].expand(B, T)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    theta = cfg.rope_parameters["rope_theta"]
    outs = [inner.embed_tokens(ids).float()]
    not_in = None if in_graph is None else (~in_graph).float()

    def construct(bwd: int) -> torch.Tensor:
        x = torch.stack(outs).sum(0)
        if not_in is not None:
            n = len(outs)
            diff = corrupted[:n] - torch.stack(outs)  # [n, B, T, D]
            x = x + torch.einsum("nbtd,n->btd", diff, not_in[:n, bwd])
        return x

    for la, layer in enumerate(inner.layers):
        att = layer.self_attn
        w = layer.input_layernorm.weight
        results = []
        qs, ks, vs = [], [], []
        for h in range(H):
            per = []
            for i, proj in enumerate((att.q_proj, att.k_proj, att.v_proj)):
                x = _rms(construct(la * (3 * H + 1) + i * H + h), w, cfg.rms_norm_eps)
                per.append(x @ proj.weight[h * d : (h + 1) * d].T)
            qs.append(per[0])
            ks.append(per[1])
            vs.append(per[2])
        q = _rope(torch.stack(qs, 1), pos, theta)  # [B, H, T, d]
        k = _rope(torch.stack(ks, 1), pos, theta)
        v = torch.stack(vs, 1)
        s = (q @ k.transpose(-1, -2)) * d**-0.5
        p = s.masked_fill(~allowed, -math.inf).softmax(-1)
        z = p @ v  # [B, H, T, d]
        for h in range(H):
            results.append(z[:, h] @ att.o_proj.weight[:, h * d : (h + 1) * d].T)
        outs += results
        x = _rms(construct(la * (3 * H + 1) + 3 * H), layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        mlp = layer.mlp
        outs.append(mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    x = _rms(construct(len(inner.layers) * (3 * H + 1)), inner.norm.weight, cfg.rms_norm_eps)
    return model.lm_head(x)[:, -1].float(), torch.stack(outs)


def logit_diff(logits: torch.Tensor, answers: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    return logits.gather(1, answers[:, None])[:, 0] - logits.gather(1, counter[:, None])[:, 0]


def evaluate_graph(model, graph: MibGraph, clean, corrupted, answers, counter) -> torch.Tensor:
    """Per-pair metric with every edge not in `graph` corrupted (`graph.prune()` first)."""
    graph.prune()
    _, corr = _run(model, corrupted, None, None)
    logits, _ = _run(model, clean, graph.in_graph, corr)
    return logit_diff(logits, answers, counter)


def evaluate_area_under_curve(model, graph: MibGraph, clean, corrupted, answers, counter, absolute=True):
    """MIB's curve: `(faithfulnesses, area_under, area_from_1, weighted_edge_counts)`."""
    base_logits, _ = _run(model, clean, None, None)
    baseline = logit_diff(base_logits, answers, counter).mean().item()
    graph.apply_topn(0, True)
    corrupted_score = evaluate_graph(model, graph, clean, corrupted, answers, counter).mean().item()
    n_items = len(graph.edges)
    faith, counts = [], []
    for pct in PERCENTAGES:
        graph.apply_topn(int(pct * n_items), absolute)
        counts.append(int(graph.in_graph.sum()))
        ablated = evaluate_graph(model, graph, clean, corrupted, answers, counter).mean().item()
        faith.append((ablated - corrupted_score) / (baseline - corrupted_score))
    area_under = area_from_1 = 0.0
    for i in range(len(faith) - 1):
        x1, x2 = PERCENTAGES[i], PERCENTAGES[i + 1]
        area_from_1 += (x2 - x1) * ((abs(1.0 - faith[i]) + abs(1.0 - faith[i + 1])) / 2)
        area_under += (x2 - x1) * ((faith[i] + faith[i + 1]) / 2)
    return faith, area_under, area_from_1, counts

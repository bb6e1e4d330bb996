"""The computational graph of a model and its decomposed forward (edge patching by hooks).

Nodes (Conmy et al. 2023; Hanna et al. 2024, Sec. 2): `input` (the residual entering layer
0: token plus position embeddings, scaled as the model scales them), every attention head
`a{l}.h{h}`, every MLP `m{l}` and `logits`. The *upstream* nodes are those that write to the
residual stream (input, heads, MLPs), U = 1 + L (H + 1) of them, indexed

    input = 0,   head (l, h) = 1 + l (H + 1) + h,   MLP l = 1 + l (H + 1) + H.

The *downstream inputs* are what reads the residual stream, Dn = L (H + 2 G + 1) + 1 of them,
indexed with S = H + 2 G + 1 per layer:

    q of head (l, h) = l S + h,   k of KV head (l, g) = l S + H + g,
    v of KV head (l, g) = l S + H + G + g,   MLP l input = l S + H + 2 G,   logits = L S.

Under grouped-query attention (G < H) the keys and values are computed once per KV head, so
edges into k / v go to the KV head `a{l}.g{g}` shared by its group. An edge u -> v exists when
u is upstream of v (`Graph.valid`, `[U, Dn]` bool).

Decomposed forward: the residual stream entering any sub-layer is the sum of the upstream
nodes' outputs (plus the constant biases of the output projections), so patching edge u -> v
means v_in' = v_in - a_u(run) + a_u(x~): only u's contribution to v's input is replaced by its
corrupted value. This is done with hooks on the model's own modules, never by re-writing
attention: a pre-hook on the attention norm reads the residual x_l; hooks on the q / k / v
projections replace their output, head by head, by the projection of `norm(x_l + delta_v)`
(the module called on one input per head, its own head's block kept); a pre-hook on `o_proj`
reads the head outputs z and splits them per head with W_O; the MLP norm and the final norm
are re-run on `x + delta`. With nothing patched the model's own path runs, so the logits are
the model's. Families where this sum decomposition is not the model's computation are refused
by name (`check_family`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import position_ids
from heads.model.adapter import HeadModel, _module, _unwrap

__all__ = ["Acts", "Graph", "check_family", "graph_of", "run_graph"]

_SKIP_LAYERS = True
"""Let `run_graph(skip=)` replace the decoder layers below the first patched input by the clean
run's recorded outputs (tests switch it off to check the full forward gives the same numbers)."""

_FAST_LINEAR = True
"""Project per-head copies through a plain `nn.Linear` by slicing its weight (tests switch it
off to check the module path gives the same numbers)."""

ATTN_NORMS = ("input_layernorm", "ln_1")
"""Attribute names of the norm applied to the residual before the attention (Llama-like, GPT-2)."""

_REFUSED_FEATURES = {
    "parallel_block": "attention and MLP read the same residual (parallel block)",
    "post_norm": "norms on the sub-layer outputs: a node's output is not its share of the residual",
    "latent_attention": "multi-head latent attention has no per-head q/k/v projections",
}


def _attn_norm(block: nn.Module) -> nn.Module | None:
    for name in ATTN_NORMS:
        m = getattr(block, name, None)
        if isinstance(m, nn.Module):
            return m
    return None


def check_family(model: HeadModel) -> None:
    """Raise a one-line `ValueError` naming the family when its forward is not a sum of node outputs.

    Refused: parallel attention + MLP blocks (GPT-J, GPT-NeoX, Phi, Cohere, StableLM), norms
    on sub-layer outputs (Gemma 2 / 3, OLMo 2), an MLP output norm, latent attention, fused
    per-head QKV layouts, MLPs that are not one module, vision-language wrappers, blocks
    without a recognised attention norm, and backends other than plain `transformers`.
    """
    fam = model.family
    name = fam.model_type
    for feat, why in _REFUSED_FEATURES.items():
        if feat in fam.features:
            raise HeadsteerValueError(f"circuit graphs do not support model_type {short_repr(name)}: {why}")
    if fam.mlp_out_norm is not None or fam.mlp is None or fam.mlp_norm is None:
        raise HeadsteerValueError(
            f"circuit graphs do not support model_type {short_repr(name)}: its MLP is not a pre-normed "
            "single module"
        )
    if fam.fused_qkv and fam.qkv_layout != "blocks":
        raise HeadsteerValueError(
            f"circuit graphs do not support model_type {short_repr(name)}: fused QKV layout "
            f"{short_repr(fam.qkv_layout)}"
        )
    if fam.vlm is not None:
        raise HeadsteerValueError(
            f"circuit graphs do not support vision-language model {short_repr(fam.vlm)} (text decoders only)"
        )
    if model.backend.kind != "hf":
        raise HeadsteerValueError(
            "circuit graphs need the plain transformers backend, got backend "
            f"{short_repr(model.backend.kind)}"
        )
    if _attn_norm(model.layers[0]) is None:
        raise HeadsteerValueError(
            f"circuit graphs do not support model_type {short_repr(name)}: no attention norm among "
            f"{ATTN_NORMS}"
        )


@dataclass(frozen=True)
class Graph:
    """The node / edge layout of a model with L layers, H query heads and G KV heads.

    Attributes:
        n_layers, n_heads, n_kv_heads: L, H, G.
        model: the model name (recorded in saved circuits).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    model: str = ""

    # ---------------------------------------------------------------- sizes and indices
    @property
    def per_layer(self) -> int:
        """S = H + 2 G + 1 downstream inputs per layer."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    @property
    def n_upstream(self) -> int:
        """U = 1 + L (H + 1) nodes that write to the residual stream."""
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def n_downstream(self) -> int:
        """Dn = L S + 1 inputs that read it."""
        return self.n_layers * self.per_layer + 1

    def head_node(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_node(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def q_input(self, layer: int, head: int) -> int:
        return layer * self.per_layer + head

    def k_input(self, layer: int, kv: int) -> int:
        return layer * self.per_layer + self.n_heads + kv

    def v_input(self, layer: int, kv: int) -> int:
        return layer * self.per_layer + self.n_heads + self.n_kv_heads + kv

    def mlp_input(self, layer: int) -> int:
        return layer * self.per_layer + self.n_heads + 2 * self.n_kv_heads

    @property
    def logits_input(self) -> int:
        return self.n_layers * self.per_layer

    def n_before(self) -> torch.Tensor:
        """`[Dn]` long: how many upstream nodes precede each downstream input (its possible sources)."""
        H, S = self.n_heads, self.per_layer
        out = torch.empty(self.n_downstream, dtype=torch.long)
        for la in range(self.n_layers):
            out[la * S : (la + 1) * S - 1] = 1 + la * (H + 1)
            out[la * S + S - 1] = 1 + la * (H + 1) + H
        out[-1] = self.n_upstream
        return out

    @property
    def valid(self) -> torch.Tensor:
        """`[U, Dn]` bool: the edges of the graph (u upstream of v)."""
        return torch.arange(self.n_upstream)[:, None] < self.n_before()[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    # ---------------------------------------------------------------- names
    def upstream_names(self) -> list[str]:
        names = ["input"]
        for la in range(self.n_layers):
            names += [f"a{la}.h{h}" for h in range(self.n_heads)] + [f"m{la}"]
        return names

    def downstream_names(self) -> list[str]:
        H, G = self.n_heads, self.n_kv_heads
        names: list[str] = []
        for la in range(self.n_layers):
            names += [f"a{la}.h{h}<q>" for h in range(H)]
            kv = "h" if G == H else "g"
            names += [f"a{la}.{kv}{g}<k>" for g in range(G)] + [f"a{la}.{kv}{g}<v>" for g in range(G)]
            names.append(f"m{la}")
        return [*names, "logits"]

    def edge_names(self, index: torch.Tensor) -> list[str]:
        """Names `"u->v"` of edges `index [E, 2]` (upstream, downstream)."""
        up, down = self.upstream_names(), self.downstream_names()
        return [f"{up[u]}->{down[d]}" for u, d in index.tolist()]

    def parse_edge(self, name: str) -> tuple[int, int]:
        """`(u, v)` of an edge name `"a0.h1->m2"`.

        Raises:
            ValueError: an unknown node name or a pair that is not an edge.
        """
        if not isinstance(name, str) or "->" not in name:
            raise HeadsteerValueError(f"edge name must look like 'a0.h1->m2', got {short_repr(name)}")
        a, b = name.split("->", 1)
        up, down = self.upstream_names(), self.downstream_names()
        if a not in up or b not in down:
            raise HeadsteerValueError(f"edge {short_repr(name)} names a node this graph does not have")
        u, d = up.index(a), down.index(b)
        if not bool(self.valid[u, d]):
            raise HeadsteerValueError(f"{short_repr(name)} is not an edge: {a} is not upstream of {b}")
        return u, d

    # ---------------------------------------------------------------- node maps
    def upstream_layer(self) -> torch.Tensor:
        """`[U]` the layer of each upstream node (-1 for input)."""
        out = torch.full((self.n_upstream,), -1, dtype=torch.long)
        for la in range(self.n_layers):
            s = 1 + la * (self.n_heads + 1)
            out[s : s + self.n_heads + 1] = la
        return out

    def down_to_node(self) -> torch.Tensor:
        """`[Dn, U + 1]` bool: which nodes each downstream input belongs to (column U = logits);
        a KV input belongs to every query head of its group."""
        H, G = self.n_heads, self.n_kv_heads
        m = torch.zeros(self.n_downstream, self.n_upstream + 1, dtype=torch.bool)
        grp = H // G
        for la in range(self.n_layers):
            for h in range(H):
                m[self.q_input(la, h), self.head_node(la, h)] = True
                m[self.k_input(la, h // grp), self.head_node(la, h)] = True
                m[self.v_input(la, h // grp), self.head_node(la, h)] = True
            m[self.mlp_input(la), self.mlp_node(la)] = True
        m[self.logits_input, self.n_upstream] = True
        return m

    def check_model(self, model: HeadModel) -> None:
        """ValueError when `model`'s geometry is not this graph's."""
        got = (model.n_layers, model.n_heads, model.n_kv_heads)
        want = (self.n_layers, self.n_heads, self.n_kv_heads)
        if got != want:
            raise HeadsteerValueError(
                f"the circuit is for (n_layers, n_heads, n_kv_heads) = {want}, the model has {got}"
            )


def graph_of(model: HeadModel) -> Graph:
    """The `Graph` of `model` (refuses families it cannot decompose, see `check_family`)."""
    check_family(model)
    return Graph(model.n_layers, model.n_heads, model.n_kv_heads, model.name)


# ------------------------------------------------------------------------------ activations
@dataclass
class Acts:
    """The upstream nodes' outputs of one run, compactly.

    Attributes:
        input: `[R, T, D]` the residual entering layer 0.
        z: per layer `[R, T, H, d]` head outputs (the `o_proj` input); head h writes
            `z[..., h, :] @ W_O[l, h]` to the residual.
        mlp: per layer `[R, T, D]` MLP outputs.
        resid: per layer `[R, T, D]` the decoder layer's output (the residual after it), or
            None where the layer did not return one tensor (then no layer is skipped, see
            `run_graph(skip=)`); empty when not recorded.
    """

    input: torch.Tensor
    z: list[torch.Tensor]
    mlp: list[torch.Tensor]
    resid: list[torch.Tensor | None] = field(default_factory=list)

    def rows(self, index: torch.Tensor) -> Acts:
        return Acts(
            self.input[index],
            [z[index] for z in self.z],
            [m[index] for m in self.mlp],
            [None if r is None else r[index] for r in self.resid],
        )

    def can_skip(self, n_layers: int) -> bool:
        """Whether every layer's output was recorded as one tensor (layers can be skipped)."""
        return len(self.resid) == n_layers and all(r is not None for r in self.resid)

    def upstream(self, w_o: list[torch.Tensor]) -> torch.Tensor:
        """`[U, R, T, D]` every upstream node's output (`w_o`: per layer `[H, d, D]`)."""
        out = [self.input[None]]
        for z, w, m in zip(self.z, w_o, self.mlp, strict=True):
            out += [torch.einsum("rthd,hdD->hrtD", z.to(w.dtype), w), m[None]]
        return torch.cat(out)


def _first(out: Any) -> torch.Tensor:
    return cast(torch.Tensor, out[0] if isinstance(out, tuple) else out)


class _Runner:
    """Hooks for one decomposed forward of R rows (see the module docstring).

    Args:
        patch: `[R, U, Dn]` bool/float edges to corrupt per row, or None.
        corr: the corrupted run's `Acts` (R rows), needed with `patch`.
        grad: inject zero deltas that require grad at every downstream input (EAP).
        record: keep this run's `Acts` (detached).
        embed: `(e_corr [R, T, D], alpha)`: the embedding output becomes
            `e_corr + alpha (e - e_corr)` (EAP-IG over the inputs).
        skip: `(l0, clean)`: layers 0 .. l0-1 are not run; each returns the clean run's recorded
            output (`clean.resid`, R rows), and the diffs of their upstream nodes are taken from
            `clean` (the run equals the clean run below the first patched input).
    """

    def __init__(
        self,
        model: HeadModel,
        graph: Graph,
        *,
        patch: torch.Tensor | None = None,
        corr: Acts | None = None,
        grad: bool = False,
        record: bool = False,
        embed: tuple[torch.Tensor, float] | None = None,
        skip: tuple[int, Acts] | None = None,
    ):
        self.m, self.g = model, graph
        self.skip = skip
        self.patch, self.corr, self.grad, self.record, self.embed = patch, corr, grad, record, embed
        L, H, G, d = graph.n_layers, graph.n_heads, graph.n_kv_heads, model.d_head
        self.H, self.G, self.d = H, G, d
        self.w_o = [model.layer_weights(la)["W_O"] for la in range(L)]
        self.x: list[torch.Tensor | None] = [None] * L  # residual entering each layer's attention
        # per layer (norm(x + delta) [a, R, T, D], active [a]) of its active q / k / v inputs
        self.normed: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * L
        self.z: list[Any] = [None] * L
        self.mlp: list[Any] = [None] * L
        self.resid: list[torch.Tensor | None] = [None] * L
        self.inp: torch.Tensor | None = None
        self.deltas: dict[str, torch.Tensor] = {}  # grad mode: the injected zero deltas
        # [R, u, T*D] a_u(x~) - a_u(run) of the upstream nodes patched in some row only (u of
        # them, in upstream order), filled as computed
        self.diff: torch.Tensor | None = None
        self.busy = False
        self.n_before = graph.n_before()
        if patch is not None:
            # the union of the rows' patches, once: which downstream inputs are active and which
            # upstream nodes are used, without scanning the [R, U, Dn] patch again per sub-layer
            self.union = patch.any(dim=0).cpu()  # [U, Dn]
            used = self.union.any(dim=1)  # [U]
            self.n_used = int(used.sum())
            self.up_pos = torch.where(used, torch.cumsum(used.long(), 0) - 1, -1)  # [U] -> diff column

    # -------------------------------------------------------------- deltas
    def _delta(self, lo: int, hi: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(delta [a, R, T, D], active [a] long)`: the deltas of the downstream inputs lo + active
        (those with an edge patched in some row, all of lo..hi-1 in grad mode); None when nothing
        is patched. Only the upstream nodes patched in some row enter the sum."""
        if self.grad:
            key = f"{lo}:{hi}"
            t = torch.zeros(hi - lo, *x.shape, dtype=x.dtype, device=x.device, requires_grad=True)
            self.deltas[key] = t
            return t, torch.arange(hi - lo)
        if self.patch is None:
            return None
        n = int(self.n_before[lo])
        pu = self.union[:n, lo:hi]
        if not bool(pu.any()):
            return None
        used = torch.nonzero(pu.any(dim=1))[:, 0]
        active = torch.nonzero(pu.any(dim=0))[:, 0]
        full = cast(torch.Tensor, self.diff)
        cols = self.up_pos[used]
        p = self.patch[:, :n, lo:hi]
        if len(used) == n:  # every upstream node: a view, no copy
            diff = full[:, :n]
        else:
            if int(cols[-1]) == len(cols) - 1:  # the first len(used) columns: a view
                diff = full[:, : len(cols)]
            else:
                diff = full[:, cols.to(full.device)]
            p = p[:, used.to(p.device)]
        p = p[:, :, active.to(p.device)].to(full.device, full.dtype)  # [R, u, a]
        delta = torch.bmm(p.transpose(1, 2), diff)  # [R, a, T*D]
        return delta.transpose(0, 1).reshape(len(active), *x.shape).to(x.dtype), active

    def _used(self, u0: int, k: int) -> torch.Tensor | None:
        """`[j]` long: which of the upstream nodes u0 .. u0+k-1 some row patches (None: none)."""
        if self.patch is None:
            return None
        sel = torch.nonzero(self.up_pos[u0 : u0 + k] >= 0)[:, 0]
        return sel if len(sel) else None

    def _set_diff(self, u0: int, value: torch.Tensor, sel: torch.Tensor | None = None) -> None:
        """Store `value [j, R, T, D]`, the diffs of upstream nodes `u0 + sel` (default: u0 ..
        u0+j-1, of which only the used ones are kept)."""
        if self.patch is None:
            return
        if sel is None:
            sel = self._used(u0, value.shape[0])
            if sel is None:
                return
            value = value[sel.to(value.device)] if len(sel) < value.shape[0] else value
        if self.diff is None:
            R = value.shape[1]
            self.diff = torch.zeros(
                R, self.n_used, value[0, 0].numel(), dtype=torch.float32, device=value.device
            )
        # the used nodes of one sub-layer get consecutive columns (up_pos counts used nodes in order)
        c0 = int(self.up_pos[u0 + int(sel[0])])
        self.diff[:, c0 : c0 + len(sel)] = value.float().transpose(0, 1).flatten(2)

    # -------------------------------------------------------------- hooks
    def install(self, stack: ExitStack) -> None:
        m, g = self.m, self.g
        fam = m.family
        if self.embed is not None:
            emb = m.model.get_input_embeddings()
            e_corr, alpha = self.embed

            def eh(mod, args, out):
                return e_corr.to(out.dtype) + alpha * (out - e_corr.to(out.dtype))

            stack.callback(emb.register_forward_hook(eh).remove)
        n_skip = 0 if self.skip is None else self.skip[0]
        for la in range(g.n_layers):
            block = m.layers[la]
            if self.record:
                stack.callback(block.register_forward_hook(self._block_hook(la)).remove)
            if la < n_skip:
                self._replace_forward(stack, block, la)
                continue
            norm1 = cast(nn.Module, _attn_norm(block))
            attn = m.attentions[la]
            stack.callback(norm1.register_forward_pre_hook(self._norm1_pre(la)).remove)
            if fam.fused_qkv:
                mod = _module(attn, cast(str, fam.qkv_proj))
                stack.callback(mod.register_forward_hook(self._fused_hook(la, norm1)).remove)
            else:
                for which, name in (("q", fam.q_proj), ("k", fam.k_proj), ("v", fam.v_proj)):
                    mod = _module(attn, cast(str, name))
                    stack.callback(mod.register_forward_hook(self._proj_hook(la, which, norm1)).remove)
            stack.callback(m.out_projs[la].register_forward_pre_hook(self._o_pre(la)).remove)
            norm2 = cast(nn.Module, m.mlp_norm(la))
            stack.callback(norm2.register_forward_hook(self._resid_hook(g.mlp_input(la), norm2)).remove)
            stack.callback(m.mlp(la).register_forward_hook(self._mlp_hook(la)).remove)
        fn = m.final_norm
        stack.callback(fn.register_forward_hook(self._resid_hook(g.logits_input, fn)).remove)

    def _block_hook(self, la: int) -> Callable[..., Any]:
        def hook(mod, args, out):
            self.resid[la] = out.detach() if isinstance(out, torch.Tensor) else None
            return None

        return hook

    def _replace_forward(self, stack: ExitStack, block: nn.Module, la: int) -> None:
        """Layer la returns the clean run's output without computing (`skip`); the diffs of its
        upstream nodes come from the clean run's activations."""
        l0, clean = cast(tuple[int, Acts], self.skip)
        out = cast(torch.Tensor, clean.resid[la])

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            if la == 0:
                self._input_diff(clean.input.to(out.device))
            self._head_diff(la, clean.z[la].to(out.device))
            self._mlp_diff(la, clean.mlp[la].to(out.device))
            return out

        block.forward = forward
        stack.callback(block.__dict__.pop, "forward", None)

    def _input_diff(self, x: torch.Tensor) -> None:
        if self._used(0, 1) is not None:
            corr = cast(Acts, self.corr)
            self._set_diff(0, (corr.input.to(x.device) - x)[None])

    def _head_diff(self, la: int, z: torch.Tensor) -> None:
        """Store the diffs of layer la's patched heads (`z [R, T, H, d]`: this run's head outputs)."""
        u0 = self.g.head_node(la, 0)
        sel = self._used(u0, self.H)
        if sel is not None:  # only the heads some row patches
            zc = cast(Acts, self.corr).z[la].to(z.device)
            w = self.w_o[la]
            hs = sel.to(z.device)
            diff = torch.einsum("rthd,hdD->hrtD", (zc[..., hs, :] - z[..., hs, :]).to(w.dtype), w[hs])
            self._set_diff(u0, diff, sel)

    def _mlp_diff(self, la: int, o: torch.Tensor) -> None:
        if self._used(self.g.mlp_node(la), 1) is not None:
            mc = cast(Acts, self.corr).mlp[la].to(o.device)
            self._set_diff(self.g.mlp_node(la), (mc - o)[None])

    def _call(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.busy = True
        try:
            return _first(mod(x))
        finally:
            self.busy = False

    def _norm1_pre(self, la: int) -> Callable[..., Any]:
        def hook(mod, args):
            if self.busy:
                return None
            x = args[0]
            self.x[la] = x
            self.normed[la] = None
            if la == 0:
                self.inp = x.detach() if self.record else None
                self._input_diff(x)
            return None

        return hook

    def _normed(self, la: int, norm1: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(norm(x_l + delta) [a, R, T, D], active [a])` for the active q / k / v inputs of layer
        la (indices 0..H+2G-1 as in the layer's downstream order; None: nothing patched)."""
        if self.normed[la] is None:
            x = cast(torch.Tensor, self.x[la])
            lo = self.g.q_input(la, 0)
            got = self._delta(lo, lo + self.H + 2 * self.G, x)
            if got is None:
                return None
            delta, active = got
            self.normed[la] = (self._call(norm1, x[None] + delta), active)
        return self.normed[la]

    def _project(self, mod: nn.Module, part: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """`[R, T, a, d]`: head `heads[i]`'s block of `mod(part[i])` (`part [a, R, T, D]`).

        A plain `nn.Linear` with no other hooks is sliced to the heads' rows of its weight (one
        projection's cost instead of a); any other module is called on every copy."""
        d = self.d
        if (
            _FAST_LINEAR
            and type(mod) is nn.Linear
            and not mod._forward_pre_hooks
            and len(mod._forward_hooks) == 1
        ):
            lin = cast(nn.Linear, mod)
            w = lin.weight
            hd = heads.to(w.device)
            wk = w.reshape(-1, d, w.shape[-1])[hd]  # [a, d, D]
            out = torch.einsum("krtD,kdD->rtkd", part.to(w.dtype), wk)
            if lin.bias is not None:
                out = out + lin.bias.reshape(-1, d)[hd]
            return out
        full = self._call(mod, part)  # [a, R, T, K d]
        a = part.shape[0]
        full = full.reshape(a, *full.shape[1:-1], -1, d)
        idx = torch.arange(a, device=full.device)
        return full[idx, ..., heads.to(full.device), :].permute(1, 2, 0, 3)

    def _proj_hook(self, la: int, which: str, norm1: nn.Module) -> Callable[..., Any]:
        H, G, d = self.H, self.G, self.d
        lo, hi = {"q": (0, H), "k": (H, H + G), "v": (H + G, H + 2 * G)}[which]

        def hook(mod, args, out):
            if self.busy:
                return None
            got = self._normed(la, norm1)
            if got is None:
                return None
            normed, active = got
            sel = (active >= lo) & (active < hi)
            if not bool(sel.any()):
                return None
            heads = active[sel] - lo
            blocks = self._project(mod, normed[sel.to(normed.device)], heads)  # [R, T, a, d]
            o = _first(out)
            if len(heads) == hi - lo and bool((heads == torch.arange(hi - lo)).all()):
                return blocks.reshape(o.shape).to(o.dtype)
            new = o.reshape(*o.shape[:-1], hi - lo, d).clone()
            new[..., heads.to(o.device), :] = blocks.to(o.dtype)
            return new.reshape(o.shape)

        return hook

    def _fused_hook(self, la: int, norm1: nn.Module) -> Callable[..., Any]:
        d = self.d

        def hook(mod, args, out):
            if self.busy:
                return None
            got = self._normed(la, norm1)
            if got is None:
                return None
            normed, active = got
            full = self._call(mod, normed)  # [a, R, T, qw + 2 kw]
            o = _first(out)
            new = o.clone()
            # input i of the layer (q heads, then k, then v KV heads) owns feature block i
            for i, j in enumerate(active.tolist()):
                new[..., j * d : (j + 1) * d] = full[i, ..., j * d : (j + 1) * d].to(o.dtype)
            return new

        return hook

    def _o_pre(self, la: int) -> Callable[..., Any]:
        H, d = self.H, self.d

        def hook(mod, args):
            if self.busy:
                return None
            z = args[0].reshape(*args[0].shape[:-1], H, d)
            if self.record:
                self.z[la] = z.detach()
            self._head_diff(la, z)
            return None

        return hook

    def _mlp_hook(self, la: int) -> Callable[..., Any]:
        def hook(mod, args, out):
            if self.busy:
                return None
            o = _first(out)
            if self.record:
                self.mlp[la] = o.detach()
            self._mlp_diff(la, o)
            return None

        return hook

    def _resid_hook(self, down: int, norm: nn.Module) -> Callable[..., Any]:
        def hook(mod, args, out):
            if self.busy:
                return None
            x = args[0]
            got = self._delta(down, down + 1, x)
            if got is None:
                return None
            new = self._call(norm, x + got[0][0])
            return (new, *out[1:]) if isinstance(out, tuple) else new

        return hook

    def acts(self) -> Acts:
        return Acts(cast(torch.Tensor, self.inp), list(self.z), list(self.mlp), list(self.resid))

    def grads(self, ordered: list[torch.Tensor]) -> torch.Tensor:
        """`[Dn, R, T, D]` the gradients of the deltas, in downstream order."""
        return torch.cat(ordered)


@contextmanager
def _hooks(runner: _Runner) -> Iterator[_Runner]:
    with ExitStack() as stack:
        runner.install(stack)
        yield runner


def run_graph(
    model: HeadModel,
    graph: Graph,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    patch: torch.Tensor | None = None,
    corr: Acts | None = None,
    grad: bool = False,
    record: bool = False,
    embed: tuple[torch.Tensor, float] | None = None,
    skip: tuple[int, Acts] | None = None,
) -> tuple[torch.Tensor, _Runner]:
    """One decomposed forward of `ids [R, T]` (`mask [R, T]`, left-padded).

    Args:
        patch: `[R, U, Dn]` bool: the edges corrupted in each row (v_in' = v_in + a_u(x~) - a_u(run)).
        corr: the corrupted run's `Acts` for the R rows (required with `patch`).
        grad: inject zero deltas requiring grad at every downstream input; `runner.deltas`
            then holds them (keys `"lo:hi"` in downstream order).
        record: keep the run's `Acts` (`runner.acts()`).
        embed: EAP-IG: `(e_corr [R, T, D], alpha)` interpolates the embedding output.
        skip: `(l0, clean)` with `clean` the clean run's recorded `Acts` for the R rows: when no
            row patches an input below layer l0, layers 0 .. l0-1 are not computed (each returns
            `clean.resid`); the logits are those of the full forward (up to float rounding).
            Ignored unless `patch` is given, nothing is recorded or differentiated, every layer
            output was recorded as one tensor and the layers have no instance `forward`
            (accelerate hooks); raises ValueError when a row patches an input below l0.

    Returns:
        `(logits [R, V] fp32 at the last position, runner)`.
    """
    if patch is not None and corr is None:
        raise HeadsteerValueError("patching edges needs the corrupted run's activations (corr=)")
    if skip is not None:
        l0, clean = skip
        if (
            not _SKIP_LAYERS
            or patch is None
            or grad
            or record
            or l0 <= 0
            or not clean.can_skip(graph.n_layers)
            or any("forward" in vars(model.layers[la]) for la in range(min(l0, graph.n_layers)))
        ):
            skip = None
        elif first_patched_layer(graph, patch) < l0:
            raise HeadsteerValueError(f"skip={l0} layers, but a row patches an input below layer {l0}")
    runner = _Runner(model, graph, patch=patch, corr=corr, grad=grad, record=record, embed=embed, skip=skip)
    dev = model.device
    with _hooks(runner):
        out = model.run(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=position_ids(mask).to(dev),
            use_cache=False,
            logits_to_keep=1,
        )
    return out.logits[:, -1].float(), runner


def embed_output(model: HeadModel, ids: torch.Tensor) -> torch.Tensor:
    """`[R, T, D]` the embedding module's output for `ids` (no hooks)."""
    emb = _unwrap(model.model.get_input_embeddings())
    with torch.no_grad():
        return cast(torch.Tensor, emb(ids.to(model.device)))


def first_patched_layer(graph: Graph, patch: torch.Tensor) -> int:
    """The lowest layer with a patched input in `patch [R, U, Dn]` (L: only the logits or nothing)."""
    down = torch.nonzero(patch.any(dim=0).any(dim=0))
    return graph.n_layers if len(down) == 0 else int(down[0, 0]) // graph.per_layer

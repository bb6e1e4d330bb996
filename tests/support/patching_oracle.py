"""An independent one-hook oracle for activation patching on any family (tests only).

For every site of a kind, the oracle runs the *whole* model once on the base prompts with one
plain hook that writes the source run's activation at that site; nothing of the product's
engine (prefix reuse, caches, edit sites, unembedding shortcuts) is used. Sites are packed into
batch rows (row `s * N + i` is site `s` on pair `i`), which changes nothing: each row is its own
sequence.

Where a kind's activation sits (written from `transformers`' modeling code, not from headsteer):

* `resid_pre[l]`: the hidden state entering decoder block l (a forward pre-hook, `hidden_states`);
* `attn_out[l]` / `mlp_out[l]`: the first output of block l's attention module / MLP;
* `z[l]` (`head_out`, `head_out_by_pos`): the input of block l's output projection, split into
  heads of `d_head` features;
* `q` / `k` / `v` / `pattern`: per head, the query `[B, H, T, d]`, key / value `[B, G, T, d]` and
  pattern `[B, H, T, K]` as the attention function receives / computes them: the oracle swaps in
  an attention function (registered with `transformers.AttentionInterface`) that calls the
  module's own `eager_attention_forward`, then, for a patched pattern, recomputes the patched
  heads' outputs as `P_src @ V`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager

import torch

ORACLE = "oracle_eager"
_LAYER_HOOK: dict[int, Callable] = {}  # id(attention module) -> fn(q, k, v, out, weights) -> out
_REGISTERED: list[bool] = []


def _register() -> None:
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def attention(module, query, key, value, attention_mask, **kw):
        fn = sys.modules[type(module).__module__].eager_attention_forward
        hook = _LAYER_HOOK.get(id(module))
        if hook is None:
            return fn(module, query, key, value, attention_mask, **kw)
        return hook(fn, module, query, key, value, attention_mask, kw)

    AttentionInterface.register(ORACLE, attention)
    AttentionMaskInterface.register(ORACLE, eager_mask)
    _REGISTERED.append(True)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token (left padding)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _configs(hm) -> list:
    seen = {id(hm.model.config): hm.model.config}
    for a in hm.attentions:
        c = getattr(a, "config", None)
        if c is not None:
            seen.setdefault(id(c), c)
    return list(seen.values())


@contextmanager
def oracle_attention(hm):
    """Within the block the model's attention calls go through the oracle's function."""
    _register()
    saved = [(c, c._attn_implementation_internal) for c in _configs(hm)]
    for c, _ in saved:
        c._attn_implementation_internal = ORACLE
    try:
        yield
    finally:
        for c, old in saved:
            c._attn_implementation_internal = old
        _LAYER_HOOK.clear()


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _replace_first(out, new):
    return (new, *out[1:]) if isinstance(out, tuple) else new


@torch.no_grad()
def forward(
    hm, ids: torch.Tensor, mask: torch.Tensor, hooks: Sequence[tuple] = (), *, uncapped: bool = False
) -> torch.Tensor:
    """The last-position logits `[R, V]` (fp32) of one whole-model forward with `hooks`:
    `(module, "pre" | "pre_kw" | "post", fn)` forward hooks, or `(attention module, "attn", fn)`
    for the oracle's attention function. `uncapped`: the model's config has its output soft-cap
    (`final_logit_softcapping`) switched off for the call."""
    with ExitStack() as stack, oracle_attention(hm):
        cfg = getattr(hm.model.config, "text_config", None) or hm.model.config
        if uncapped and getattr(cfg, "final_logit_softcapping", None) is not None:
            cap = cfg.final_logit_softcapping
            cfg.final_logit_softcapping = None
            stack.callback(setattr, cfg, "final_logit_softcapping", cap)
        for module, kind, fn in hooks:
            if kind == "attn":
                _LAYER_HOOK[id(module)] = fn
                continue
            if kind == "pre":
                h = module.register_forward_pre_hook(fn)
            elif kind == "pre_kw":
                h = module.register_forward_pre_hook(fn, with_kwargs=True)
            else:
                h = module.register_forward_hook(fn)
            stack.callback(h.remove)
        out = hm.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
    return out.logits[:, -1].float()


def mlp_module(hm, layer: int):
    """Block `layer`'s MLP module (family paths read from the model's own attribute names)."""
    block = hm.layers[layer]
    for name in ("mlp", "feed_forward", "block_sparse_moe"):
        if hasattr(block, name):
            return getattr(block, name)
    raise AttributeError(f"no MLP module in {type(block).__name__}")


@torch.no_grad()
def record(hm, ids: torch.Tensor, mask: torch.Tensor, layers: Sequence[int], kinds: Sequence[str]) -> dict:
    """`{(kind, layer): activation}` of one plain run (kinds as `KINDS` of the product, with `z`
    for both head-output kinds)."""
    seen: dict = {}
    hooks: list[tuple] = []
    H, d = hm.n_heads, hm.d_head
    for la in layers:
        if "resid_pre" in kinds:

            def rp(mod, args, kwargs, la=la):
                seen[("resid_pre", la)] = (args[0] if args else kwargs["hidden_states"]).clone()

            hooks.append((hm.layers[la], "pre_kw", rp))
        if "attn_out" in kinds:
            hooks.append(
                (
                    hm.attentions[la],
                    "post",
                    lambda m, a, o, la=la: seen.__setitem__(("attn_out", la), _first(o).clone()),
                )
            )
        if "mlp_out" in kinds:

            def mh(mod, args, out, la=la):  # Llama 4's MoE returns its rows flattened: [B * T, D]
                o = _first(out)
                seen[("mlp_out", la)] = o.reshape(*args[0].shape[:-1], o.shape[-1]).clone()

            hooks.append((mlp_module(hm, la), "post", mh))
        if "z" in kinds:

            def zh(mod, args, la=la):
                x = args[0]
                seen[("z", la)] = x.reshape(*x.shape[:-1], H, d).clone()

            hooks.append((hm.out_projs[la], "pre", zh))
        if any(k in kinds for k in ("q", "k", "v", "pattern")):

            def ah(fn, module, q, k, v, m, kw, la=la):
                out, w = fn(module, q, k, v, m, **kw)
                seen[("q", la)], seen[("k", la)], seen[("v", la)] = q.clone(), k.clone(), v.clone()
                seen[("pattern", la)] = w.clone()
                return out, w

            hooks.append((hm.attentions[la], "attn", ah))
    forward(hm, ids, mask, hooks)
    return seen


def _rows(x: torch.Tensor, n_sites: int) -> torch.Tensor:
    return x.repeat(n_sites, *([1] * (x.dim() - 1)))


@torch.no_grad()
def patch_loop(
    hm,
    base_ids: torch.Tensor,
    src_ids: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    layer: int,
    sites: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """`[S, N, V]` last-position logits: base prompts with kind's activation at each site
    `(index, position)` of `layer` (index = head / KV head, -1 for block kinds; position = a padded
    column, -1 for every column) taken from the source prompts' plain run."""
    key = "z" if kind in ("head_out", "head_out_by_pos") else kind
    src = record(hm, src_ids, mask, [layer], [key])[(key, layer)]
    N, T = base_ids.shape
    S = len(sites)
    src_rows = _rows(src, S)  # [S * N, ...]

    def where(shape_after_t: int, heads_dim: int | None, head_first: bool = False) -> torch.Tensor:
        """[S*N, T, ...] bool: which entries each row replaces."""
        w = torch.zeros(S, N, T, dtype=torch.bool)
        for s, (_, pos) in enumerate(sites):
            if pos < 0:
                w[s] = True
            else:
                w[s, :, pos] = True
        w = w.reshape(S * N, T)
        if heads_dim is None:
            return w[..., None]
        hm_ = torch.zeros(S, heads_dim, dtype=torch.bool)
        for s, (idx, _) in enumerate(sites):
            hm_[s, idx] = True
        hm_ = hm_.repeat_interleave(N, 0)  # [S*N, heads]
        if head_first:  # [R, heads, T, 1]
            return (hm_[:, :, None] & w[:, None, :])[..., None]
        return (w[:, :, None] & hm_[:, None, :])[..., None]  # [R, T, heads, 1]

    hooks: list[tuple] = []
    if kind == "resid_pre":
        wm = where(0, None)

        def rp(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            x = torch.where(wm, src_rows.to(x.dtype), x)
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        hooks.append((hm.layers[layer], "pre_kw", rp))
    elif kind in ("attn_out", "mlp_out"):
        wm = where(0, None)
        module = hm.attentions[layer] if kind == "attn_out" else mlp_module(hm, layer)

        def post(mod, args, out):
            o = _first(out)
            flat = o.reshape(src_rows.shape)
            return _replace_first(out, torch.where(wm, src_rows.to(o.dtype), flat).reshape(o.shape))

        hooks.append((module, "post", post))
    elif key == "z":
        wm = where(0, hm.n_heads)

        def zh(mod, args):
            x = args[0]
            z = x.reshape(*x.shape[:-1], hm.n_heads, hm.d_head)
            return (torch.where(wm, src_rows.to(x.dtype), z).reshape(x.shape), *args[1:])

        hooks.append((hm.out_projs[layer], "pre", zh))
    elif kind in ("q", "k", "v"):
        n = src.shape[1]
        wm = where(0, n, head_first=True)  # [R, heads, T, 1]
        j = "qkv".index(kind)

        def ah(fn, module, q, k, v, m, kw):
            qkv = [q, k, v]
            qkv[j] = torch.where(wm, src_rows.to(qkv[j].dtype), qkv[j])
            return fn(module, *qkv, m, **kw)

        hooks.append((hm.attentions[layer], "attn", ah))
    elif kind == "pattern":
        heads = where(0, hm.n_heads, head_first=True)[:, :, 0, 0]  # [R, H] (every position)

        def ah(fn, module, q, k, v, m, kw):
            out, w = fn(module, q, k, v, m, **kw)
            vr = v.repeat_interleave(q.shape[1] // v.shape[1], 1)  # [R, H, K, d]
            p = torch.where(heads[:, :, None, None], src_rows.to(w.dtype), w)
            new = (p @ vr).transpose(1, 2)  # [R, T, H, d]
            return torch.where(heads[:, None, :, None], new.to(out.dtype), out), p

        hooks.append((hm.attentions[layer], "attn", ah))
    else:
        raise ValueError(kind)
    logits = forward(hm, _rows(base_ids, S), _rows(mask, S), hooks)
    return logits.reshape(S, N, -1)


@torch.no_grad()
def path_to_logits_loop(
    hm,
    base_ids: torch.Tensor,
    src_ids: torch.Tensor,
    mask: torch.Tensor,
    senders: Sequence[tuple[int, int]],
    positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """`[S, N, V]` last-position logits of path patching to the logits (Wang et al. 2022, Sec.
    3.1, receivers = the logits, MLPs recomputed): the base prompts with each sender head's output
    z replaced by its source value (at `positions`, default every column) and every head of every
    later layer frozen to its base value; one whole-model forward, plain o_proj pre-hooks."""
    L = hm.n_layers
    base = record(hm, base_ids, mask, range(L), ["z"])
    src = record(hm, src_ids, mask, range(L), ["z"])
    N, T = base_ids.shape
    S = len(senders)
    cols = torch.zeros(T, dtype=torch.bool)
    cols[list(range(T)) if positions is None else list(positions)] = True
    hooks = []
    for la in range(L):
        put = torch.zeros(S, hm.n_heads, dtype=torch.bool)  # rows whose sender sits in this layer
        frozen = torch.zeros(S, dtype=torch.bool)  # rows whose sender sits below this layer
        for s, (ls, h) in enumerate(senders):
            put[s, h] = ls == la
            frozen[s] = ls < la
        put = put.repeat_interleave(N, 0)[:, None, :, None] & cols[None, :, None, None]
        frozen = frozen.repeat_interleave(N, 0)[:, None, None, None]
        b, sr = _rows(base[("z", la)], S), _rows(src[("z", la)], S)

        def zh(mod, args, put=put, frozen=frozen, b=b, sr=sr):
            x = args[0]
            z = x.reshape(*x.shape[:-1], hm.n_heads, hm.d_head)
            z = torch.where(frozen, b.to(x.dtype), torch.where(put, sr.to(x.dtype), z))
            return (z.reshape(x.shape), *args[1:])

        hooks.append((hm.out_projs[la], "pre", zh))
    return forward(hm, _rows(base_ids, S), _rows(mask, S), hooks).reshape(S, N, -1)

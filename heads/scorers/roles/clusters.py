"""Pattern discovery: record every head's attention on a task, describe it by how much falls on
each named pattern, cluster the heads and name the clusters (docs/methods/pattern_injection.md).

Li et al. (EMNLP 2022, arXiv:2112.05364) discover task patterns with a human in the loop: the
T3-Vis tool shows the heads' attention (and head importance) and the analyst names the recurring
shapes (matching token, intra-sentence, positional). Here the same step is made reproducible and
left for the human to review: each head gets a feature vector, the mean over the task's real query
rows of

* the attention mass on each named pattern's support (`heads.scorers.roles.named`:
  previous-token, first-token, same-sentence, matching-token, and attend-to-span when the prompts
  mark a span; only rows where the pattern is not empty count), plus the mass on the row itself
  (`self`);
* the normalised entropy `H(A_i) / log(n_i)` (rows with n_i >= 2 visible keys);

the heads are clustered with k-means (scikit-learn, standardised features, `seed`), and each
cluster is named by the pattern whose centroid mass exceeds the mass a uniform head would put on
the same keys (`PatternClusters.uniform`) the most, when that mass is at least `name_threshold`
(default 0.5) and the excess at least 0.25; else `"diffuse"` (mean entropy >= 0.5) or `"mixed"`. A
name given twice gets a suffix (`previous-token-2`). `record_pattern` reads one head's `[T, T]`
attention on one prompt, a template for `steer.pattern_injection.PatternInjection`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_int, check_number, check_seed, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.forward import forward
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import Emphasis, EncodedPrompts, Prompt, encode_prompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSet
from heads.scorers.roles.named import PatternContext, named_support

__all__ = ["FEATURES", "PatternClusters", "pattern_clusters", "pattern_features", "record_pattern"]

FEATURES = ("previous-token", "first-token", "same-sentence", "matching-token", "attend-to-span", "self")
"""Mass features of `pattern_features` (attend-to-span only when the prompts mark a span); plus `entropy`."""

MAX_CLUSTERS = 64


def _encode(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts,
    emphasize: Emphasis,
    chat: bool | None,
) -> EncodedPrompts:
    if isinstance(prompts, EncodedPrompts):
        return prompts
    if model.tokenizer is None:
        raise HeadsteerValueError("pattern discovery needs a HeadModel with a tokenizer")
    return encode_prompts(model.tokenizer, prompts, emphasize=emphasize, chat=chat)


@torch.no_grad()
def record_pattern(
    model: HeadModel, prompt: Prompt | EncodedPrompts, layer: int, head: int, *, chat: bool | None = False
) -> torch.Tensor:
    """`[T, T]` fp32 attention of query head `head` in `layer` over the T real tokens of one prompt
    (row = query, column = key; padding dropped), a template for `PatternInjection(pattern=...)`.

    Raises:
        ValueError: an unknown layer or head, more than one prompt, an empty prompt.
    """
    model.check_head(layer, head)
    enc = _encode(model, prompt, None, chat)
    if enc.batch != 1:
        raise HeadsteerValueError(f"record_pattern takes one prompt, got {enc.batch}")
    rec = Recorder(layer=layer, heads=[head], fn=lambda p, c: p[0, head].detach().float().cpu())
    with editing(model, [rec], require_fired=True):
        forward(model, enc)
    full = torch.cat(rec.records, dim=0)  # [P, P]
    first = int((~enc.attention_mask[0].bool()).sum())
    return full[first:, first:].contiguous()


def pattern_features(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts,
    *,
    emphasize: Emphasis = None,
    chat: bool | None = False,
    batch_size: int = 8,
    progress: ProgressArg = None,
) -> pd.DataFrame:
    """Per-head pattern features on a task (module docstring): one row per (layer, head) with the
    mean mass on each pattern of `FEATURES` (NaN for a pattern no row has; `attend-to-span` only
    when a prompt marks a span) and `entropy`.

    Args:
        prompts: the task's prompts (texts, chats, or an `EncodedPrompts`).
        emphasize, chat: as `heads.encode_prompts` (chat default False: the plain text).
        batch_size: prompts per forward (default 8).
        progress: True, False / None (default) or `progress(done, total)` in prompts.

    Raises:
        ValueError: bad prompts or batch_size (before any forward).
    """
    batch_size = check_int("batch_size", batch_size, lo=1)
    enc = _encode(model, prompts, emphasize, chat)
    model.check_length(enc.length)
    feats = [f for f in FEATURES if f != "attend-to-span" or any(enc.spans)]
    names = [*feats, "entropy"]
    L, H = model.n_layers, model.n_heads
    names += ["uniform:" + n for n in feats]
    num = {n: torch.zeros(L, H, dtype=torch.float64) for n in names}
    den = {n: torch.zeros(L, H, dtype=torch.float64) for n in names}
    with progress_callback(progress, "pattern features", "prompts") as report:
        for s in range(0, enc.batch, batch_size):
            sub = _slice(enc, s, s + batch_size)
            ctx = PatternContext.of(sub, model.tokenizer)

            def reduce(probs: torch.Tensor, call: AttentionCall, ctx: PatternContext = ctx) -> dict:
                p = probs.float()
                out = {}
                dev = p.device
                vis = _visible(ctx, call)
                for n in feats:
                    if n == "self":
                        q = torch.arange(call.q_offset, call.q_offset + call.q_len, device=dev)
                        sup = (torch.arange(call.k_len, device=dev)[None, :] == q[:, None])[None] & vis
                    else:
                        sup = named_support(n, ctx, call.q_offset, call.q_len, call.k_len, dev)
                    rows = sup.any(-1)  # [B, Q]
                    mass = (p * sup[:, None]).sum(-1)  # [B, H, Q]
                    out[n] = ((mass * rows[:, None]).sum((0, 2)), rows.sum().expand(p.shape[1]).float())
                    share = sup.sum(-1) / vis.sum(-1).clamp(min=1)  # a uniform head's mass
                    out["uniform:" + n] = ((share * rows).sum().reshape(1), rows.sum().reshape(1).float())
                n_vis = vis.sum(-1)  # [B, Q]
                ok = n_vis >= 2
                ent = (
                    -(p * torch.log(p.clamp(min=1e-30))).sum(-1)
                    / torch.log(n_vis.clamp(min=2).float())[:, None]
                )
                out["entropy"] = ((ent * ok[:, None]).sum((0, 2)), ok.sum().expand(p.shape[1]).float())
                return {k: (a.double().cpu(), b.double().cpu()) for k, (a, b) in out.items()}

            recs = [Recorder(layer=la, fn=reduce) for la in range(L)]
            with editing(model, recs):
                forward(model, sub)
            for la, rec in enumerate(recs):
                for r in rec.records:
                    for n in names:
                        num[n][la] += r[n][0]
                        den[n][la] += r[n][1]
            if report is not None:
                report(min(s + batch_size, enc.batch), enc.batch)
    rows = []
    for la in range(L):
        for h in range(H):
            row: dict[str, object] = {"layer": la, "head": h, "kv_head": model.kv_head(h)}
            for n in (*feats, "entropy"):
                d = float(den[n][la, h])
                row[n] = float(num[n][la, h]) / d if d > 0 else float("nan")
            rows.append(row)
    frame = pd.DataFrame(rows)
    uniform = {}
    for n in feats:  # the same in every layer and head: read layer 0, head 0
        d = float(den["uniform:" + n][0, 0])
        uniform[n] = float(num["uniform:" + n][0, 0]) / d if d > 0 else float("nan")
    frame.attrs["uniform"] = uniform
    return frame


def _visible(ctx: PatternContext, call: AttentionCall) -> torch.Tensor:
    dev = call.device
    first = ctx.first.to(dev)[:, None, None]
    q = torch.arange(call.q_offset, call.q_offset + call.q_len, device=dev)[None, :, None]
    k = torch.arange(call.k_len, device=dev)[None, None, :]
    return (k <= q) & (k >= first)


def _slice(enc: EncodedPrompts, a: int, b: int) -> EncodedPrompts:
    """Rows a..b-1 of `enc`, re-padded to their own longest row."""
    mask = enc.attention_mask[a:b]
    cut = int((~mask.bool()).sum(-1).min())
    spans = [[(t0 - cut, t1 - cut) for t0, t1 in r] for r in enc.spans[a:b]]
    return EncodedPrompts(enc.input_ids[a:b, cut:], mask[:, cut:], spans, enc.texts[a:b], enc.char_spans[a:b])


@dataclass
class PatternClusters:
    """Result of `pattern_clusters`.

    Attributes:
        frame: one row per (layer, head): the features, `cluster` (int) and `name`.
        centroids: one row per cluster: the mean features of its heads, `name`, `size`.
        features: the feature columns clustered.
        params: the settings used; model: the model's name.
        uniform: per mass feature, the mass a uniform head would put there on the same rows.
    """

    frame: pd.DataFrame
    centroids: pd.DataFrame
    features: list[str]
    params: dict = field(default_factory=dict)
    model: str = ""
    uniform: dict[str, float] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """The cluster names, in cluster order."""
        return list(self.centroids["name"])

    def heads(self, name: str) -> HeadSet:
        """The heads of the cluster named `name` (HeadsteerValueError naming the clusters otherwise)."""
        if name not in self.names:
            raise HeadsteerValueError(f"no cluster named {short_repr(name)}; the clusters are {self.names}")
        sel = self.frame[self.frame["name"] == name]
        return HeadSet(zip(sel["layer"].astype(int), sel["head"].astype(int), strict=True))

    def head_scores(self, feature: str) -> HeadScores:
        """`HeadScores [L, H]` of one feature column (for a heatmap)."""
        if feature not in self.frame.columns or feature in ("layer", "head", "kv_head", "cluster", "name"):
            raise HeadsteerValueError(f"unknown feature {short_repr(feature)}; use one of {self.features}")
        n_l, n_h = int(self.frame["layer"].max()) + 1, int(self.frame["head"].max()) + 1
        s = torch.tensor(self.frame[feature].to_numpy(dtype=np.float32)).reshape(n_l, n_h)
        return HeadScores(s, f"pattern_{feature}", self.params, self.model)

    def to_frame(self) -> pd.DataFrame:
        """The per-head table (a copy)."""
        return self.frame.copy()


def name_clusters(
    centroids: pd.DataFrame,
    features: Sequence[str],
    uniform: dict[str, float],
    threshold: float = 0.5,
    lift: float = 0.25,
) -> list[str]:
    """A name per centroid row (module docstring): the mass feature whose centroid mass exceeds a
    uniform head's mass on the same rows (`uniform`) the most, if its mass is >= `threshold` and the
    excess >= `lift`; else `"diffuse"` (mean entropy >= 0.5) or `"mixed"`. Repeats get `-2`, `-3`, ..."""
    mass = [f for f in features if f != "entropy"]
    seen: dict[str, int] = {}
    out = []
    for _, c in centroids.iterrows():
        excess = {
            f: float(c[f]) - uniform.get(f, 0.0)
            for f in mass
            if np.isfinite(c[f]) and np.isfinite(uniform.get(f, 0.0))
        }
        best = max(excess, key=lambda f: excess[f]) if excess else None
        if best is not None and float(c[best]) >= threshold and excess[best] >= lift:
            name = best
        else:
            name = "diffuse" if float(c.get("entropy", 0.0)) >= 0.5 else "mixed"
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return out


def pattern_clusters(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts,
    *,
    n_clusters: int = 6,
    emphasize: Emphasis = None,
    chat: bool | None = False,
    name_threshold: float = 0.5,
    batch_size: int = 8,
    seed: int = 0,
    progress: ProgressArg = None,
) -> PatternClusters:
    """Cluster every head by its pattern features on `prompts` and name the clusters (module docstring).

    Args:
        n_clusters: k of k-means (1..min(64, heads); default 6).
        name_threshold: least centroid mass for a pattern name (in (0, 1], default 0.5).
        seed: k-means seed (an int in 0..2**32 - 1, default 0).
        emphasize, chat, batch_size, progress: as `pattern_features`.

    Returns:
        `PatternClusters`.

    Raises:
        ValueError: bad `n_clusters`, `name_threshold`, `seed`, prompts (all before any forward).
    """
    from sklearn.cluster import KMeans

    n_heads = model.n_layers * model.n_heads
    k = check_int("n_clusters", n_clusters, lo=1, hi=min(MAX_CLUSTERS, n_heads))
    thr = check_number("name_threshold", name_threshold, lo=0, hi=1, lo_open=True)
    seed = check_seed("seed", seed)
    if not isinstance(chat, bool | type(None)):
        raise HeadsteerTypeError(f"chat must be True, False or None, got {short_repr(chat)}")
    enc = _encode(model, prompts, emphasize, chat)
    frame = pattern_features(model, enc, batch_size=batch_size, progress=progress)
    feats = [c for c in frame.columns if c not in ("layer", "head", "kv_head") and frame[c].notna().any()]
    x = frame[feats].fillna(0.0).to_numpy(dtype=np.float64)
    sd = x.std(0)
    z = (x - x.mean(0)) / np.where(sd > 0, sd, 1.0)
    labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(z)
    frame["cluster"] = labels
    cent = frame.groupby("cluster")[feats].mean().reindex(range(k))
    cent["size"] = frame.groupby("cluster").size().reindex(range(k)).fillna(0).astype(int)
    uniform = dict(frame.attrs.get("uniform", {}))
    cent["name"] = name_clusters(cent, feats, uniform, thr)
    frame["name"] = [cent.loc[c, "name"] for c in labels]
    params = {"n_clusters": k, "name_threshold": thr, "seed": seed, "n_prompts": enc.batch}
    return PatternClusters(frame, cent.reset_index(), feats, params, model.name, uniform)

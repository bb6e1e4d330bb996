"""Models whose circuit is known by construction, and how well a circuit finder recovers it.

A circuit finder is checked against a circuit that is known (Conmy et al. 2023, ACDC, Sec. 4;
Syed et al. 2024, EAP, Sec. 4: ROC-AUC of the edge scores against hand-found circuits; tracr
programs): here the weights of a small attention-only GPT-2 (its MLPs are zero) are set by hand,
so the edges that carry the behaviour are known exactly. Two models (`KINDS`), 2 layers of 4
heads each, d_model 80, d_head 20, a 20-token vocabulary and 16 positions:

* `"induction"`: head a0.h0 is a **previous-token head** (its query and key read the position
  embeddings, so position i attends to i - 1; its OV copies the token at i - 1 into a "previous
  token" subspace); head a1.h0 is an **induction head** (its query reads the current token, its
  key the previous-token subspace, so at the last token X it attends to the token after the
  earlier X; its OV copies that token to an output subspace the unembedding reads). On
  `[.. X Y .. X]` the model predicts Y. Known edges: `input->a0.h0<v>`, `a0.h0->a1.h0<k>`,
  `input->a1.h0<q>`, `input->a1.h0<v>`, `a1.h0->logits`.
* `"two_hop"`: a name-mover-like two-hop copy: head a0.h0 attends from every position to
  position 0 and copies its token (the "name") into a middle subspace; head a1.h0 attends to the
  previous position and copies the middle subspace to the output. On `[N f f .. f]` the model
  predicts N. Known edges: `input->a0.h0<v>`, `a0.h0->a1.h0<v>`, `a1.h0->logits`.

Every other head is a distractor with small random weights (std 0.02). The embeddings have zero
mean (each one-hot block has a balancing coordinate), so the layer norms only rescale. Pairs:
the clean prompt against a corrupted one of the same structure and other tokens (induction: a
fresh sequence; two-hop: another name), metric the logit difference (answer - corrupted answer).

`recovery_auc` scores a method by the ROC-AUC of |edge score| over every edge of the graph
against the known edges (scikit-learn's `roc_auc_score`); `recovery` runs EAP, EAP-IG, exact
edge patching and activation patching (a node method: an edge scores the product of its
source's and its target input's noising effect; the input and the logits count 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from heads._util.validation import check_int, check_seed, short_repr
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.scorers.patching.pairs import PairBatch, PromptPair, pairs_from_tokens

__all__ = [
    "KINDS",
    "KnownCircuit",
    "activation_patching_edge_scores",
    "known_circuit",
    "recovery",
    "recovery_auc",
    "save_known_circuit",
]

KINDS = ("induction", "two_hop")
N_VOCAB, N_POS, N_HEADS, D_HEAD = 20, 16, 4, 20
D_MODEL = N_HEADS * D_HEAD  # 80 = 4 one-hot blocks of 20 (tokens, positions + pad, prev/middle, output)
SEQ = 12
DISTRACTOR_STD = 0.02
# residual layout: [0, 20) token, [20, 36) position, 36..39 balancing coordinates,
# [40, 60) previous token / middle, [60, 80) output
TOK, POS, PREV, OUT = 0, 20, 40, 60
BAL_TOK, BAL_POS, BAL_MID, BAL_OUT = 36, 37, 38, 39
KNOWN_EDGES = {
    "induction": (
        "input->a0.h0<v>",
        "a0.h0->a1.h0<k>",
        "input->a1.h0<q>",
        "input->a1.h0<v>",
        "a1.h0->logits",
    ),
    "two_hop": ("input->a0.h0<v>", "a0.h0->a1.h0<v>", "a1.h0->logits"),
}


@dataclass
class KnownCircuit:
    """A hand-built model, its pairs and its known edges.

    Attributes:
        kind: `"induction"` or `"two_hop"`.
        model: the `HeadModel` (a `transformers` GPT-2, fp32, CPU; tokenizer None: token ids).
        pairs: the clean / corrupted `PairBatch` (token ids; answer = the clean prediction,
            counterfactual = the corrupted prediction).
        edges: the known edges, named as `heads.scorers.circuits.Graph.edge_names`.
    """

    kind: str
    model: HeadModel
    pairs: PairBatch
    edges: tuple[str, ...]

    def labels(self) -> torch.Tensor:
        """`[E]` bool over the graph's edges (`Graph.valid` order): True on the known edges."""
        from heads.scorers.circuits import graph_of

        g = graph_of(self.model)
        names = g.edge_names(torch.nonzero(g.valid))
        return torch.tensor([n in self.edges for n in names])


def _one_hot_block(start: int, index: int, bal: int, scale: float) -> torch.Tensor:
    v = torch.zeros(D_MODEL)
    v[start + index] = scale
    v[bal] = -scale
    return v


def _gpt2(seed: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=N_VOCAB,
        n_positions=N_POS,
        n_embd=D_MODEL,
        n_layer=2,
        n_head=N_HEADS,
        n_inner=4 * D_MODEL,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for block in model.transformer.h:
            for ln in (block.ln_1, block.ln_2):
                ln.weight.fill_(1.0)
            # distractors: every head small and random; head 0 of each layer is set below
            block.attn.c_attn.weight.copy_(torch.randn(D_MODEL, 3 * D_MODEL, generator=gen) * DISTRACTOR_STD)
            block.attn.c_proj.weight.copy_(torch.randn(D_MODEL, D_MODEL, generator=gen) * DISTRACTOR_STD)
        model.transformer.ln_f.weight.fill_(1.0)
        for v in range(N_VOCAB):
            model.transformer.wte.weight[v] = _one_hot_block(TOK, v, BAL_TOK, 1.0)
            model.lm_head.weight[v, OUT + v] = 1.0
        for p_ in range(N_POS):
            model.transformer.wpe.weight[p_] = _one_hot_block(POS, p_, BAL_POS, 1.0)
    return model


def _set_head(block: Any, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> None:
    """Head 0 of `block`: `q`, `k`, `v` `[D_MODEL, D_HEAD]` (residual -> head), `o` `[D_HEAD, D_MODEL]`."""
    w = block.attn.c_attn.weight  # Conv1D [in, 3 * D]: q | k | v, head h at columns h * d ...
    w[:, 0:D_HEAD] = q
    w[:, D_MODEL : D_MODEL + D_HEAD] = k
    w[:, 2 * D_MODEL : 2 * D_MODEL + D_HEAD] = v
    block.attn.c_proj.weight[0:D_HEAD] = o


# the layer norm divides by the residual's std: ~ sqrt(4 / 80) for two +-1 blocks, so the
# logits of a query-key match are scaled by ~ 20 before the 1 / sqrt(d_head) of attention
SHARP = 2.0
COPY = 0.25  # the value reads the normed residual (entries ~4.5): a copy of about unit size


@torch.no_grad()
def _induction(seed: int) -> Any:
    model = _gpt2(seed)
    a, b = model.transformer.h
    eye = torch.eye(D_HEAD)
    q, k, v, o = (torch.zeros(D_MODEL, D_HEAD) for _ in range(4))
    for i in range(1, N_POS):  # previous-token head: query of position i = key of position i - 1
        q[POS + i, i - 1] = SHARP
    for j in range(N_POS):
        k[POS + j, j] = SHARP
    v[TOK : TOK + N_VOCAB] = eye  # copies the token
    o = torch.zeros(D_HEAD, D_MODEL)
    o[:, PREV : PREV + N_VOCAB] = COPY * eye
    o[:, BAL_MID] = -COPY
    _set_head(a, q=q, k=k, v=v, o=o)
    q, k, v = (torch.zeros(D_MODEL, D_HEAD) for _ in range(3))
    q[TOK : TOK + N_VOCAB] = SHARP * eye  # induction head: current token against the previous one
    k[PREV : PREV + N_VOCAB] = SHARP * eye
    v[TOK : TOK + N_VOCAB] = eye
    o = torch.zeros(D_HEAD, D_MODEL)
    o[:, OUT : OUT + N_VOCAB] = COPY * eye
    o[:, BAL_OUT] = -COPY
    _set_head(b, q=q, k=k, v=v, o=o)
    return model


@torch.no_grad()
def _two_hop(seed: int) -> Any:
    model = _gpt2(seed)
    a, b = model.transformer.h
    eye = torch.eye(D_HEAD)
    q, k, v = (torch.zeros(D_MODEL, D_HEAD) for _ in range(3))
    q[POS : POS + N_POS, 0] = SHARP  # every position queries "position 0"
    k[POS + 0, 0] = SHARP
    v[TOK : TOK + N_VOCAB] = eye
    o = torch.zeros(D_HEAD, D_MODEL)
    o[:, PREV : PREV + N_VOCAB] = COPY * eye
    o[:, BAL_MID] = -COPY
    _set_head(a, q=q, k=k, v=v, o=o)
    q, k, v = (torch.zeros(D_MODEL, D_HEAD) for _ in range(3))
    for i in range(1, N_POS):  # attends to the previous position
        q[POS + i, i - 1] = SHARP
    for j in range(N_POS):
        k[POS + j, j] = SHARP
    v[PREV : PREV + N_VOCAB] = eye  # reads the middle subspace (the name)
    o = torch.zeros(D_HEAD, D_MODEL)
    o[:, OUT : OUT + N_VOCAB] = COPY * eye
    o[:, BAL_OUT] = -COPY
    _set_head(b, q=q, k=k, v=v, o=o)
    return model


def _sequences(kind: str, n: int, gen: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """`n` token rows of length SEQ and their known next token."""
    rows, answers = [], []
    for _ in range(n):
        toks = torch.randperm(N_VOCAB, generator=gen)[: SEQ - 1].tolist()
        if kind == "induction":
            m = int(torch.randint(1, SEQ - 3, (1,), generator=gen))  # X at m, Y at m + 1, X last
            row = [*toks, toks[m]]
            answers.append(toks[m + 1])
        else:
            row = [toks[0], *([toks[1]] * (SEQ - 1))]  # the name, then one filler token
            answers.append(toks[0])
        rows.append(row)
    return rows, answers


def known_circuit(kind: str = "induction", *, n_pairs: int = 16, seed: int = 0) -> KnownCircuit:
    """The hand-built model of `kind` (`KINDS`), `n_pairs` pairs and its known edges.

    Args:
        kind: `"induction"` (default) or `"two_hop"` (module docstring).
        n_pairs: clean / corrupted pairs, 1..1000 (default 16).
        seed: seeds the distractor weights and the pairs (0..2**32 - 1).

    Raises:
        ValueError: an unknown kind, a bad n_pairs or seed.
    """
    if kind not in KINDS:
        raise HeadsteerValueError(
            f"unknown known-circuit kind {short_repr(kind)}: use one of {', '.join(KINDS)}"
        )
    n_pairs = check_int("n_pairs", n_pairs, lo=1, hi=1000)
    seed = check_seed("seed", seed)
    model = _induction(seed) if kind == "induction" else _two_hop(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    clean, answers = _sequences(kind, n_pairs, gen)
    if kind == "induction":
        corrupt, counter = _sequences(kind, n_pairs, gen)
    else:  # another name, the same filler
        corrupt, counter = [], []
        for row in clean:
            other = [t for t in range(N_VOCAB) if t not in row]
            name = other[int(torch.randint(len(other), (1,), generator=gen))]
            corrupt.append([name, *row[1:]])
            counter.append(name)
    meta: list[PromptPair | None] = [
        PromptPair(f"{kind}-{i}", f"{kind}-{i}-corrupted", a) for i, a in enumerate(answers)
    ]
    pairs = pairs_from_tokens(clean, corrupt, answers, counter, pairs=meta)
    hm = HeadModel(model, None, name=f"known-circuit-{kind}")
    return KnownCircuit(kind, hm, pairs, KNOWN_EDGES[kind])


def save_known_circuit(
    kind: str, folder: str | os.PathLike, *, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write the model of `kind` as a Hugging Face folder (`config.json`, safetensors weights and a
    word-level tokenizer of tokens `t0` .. `t19`) that `heads.load_model(folder)` and
    `headsteer --model folder` load; returns the folder.

    Raises:
        ValueError: an unknown kind; `folder` exists and is not empty, unless `overwrite`.
    """
    if kind not in KINDS:
        raise HeadsteerValueError(
            f"unknown known-circuit kind {short_repr(kind)}: use one of {', '.join(KINDS)}"
        )
    out = Path(folder)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise HeadsteerValueError(f"{str(out)!r} exists and is not empty (overwrite=True replaces its files)")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = _induction(seed) if kind == "induction" else _two_hop(seed)
    vocab = {f"t{i}": i for i in range(N_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t0")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------ recovery
def recovery_auc(labels: torch.Tensor, scores: torch.Tensor) -> float:
    """ROC-AUC of `|scores|` `[E]` against the known edges `labels` `[E]` bool (NaN scores count
    as 0): 1 = every known edge ranked above every other edge, 0.5 = chance.

    Raises:
        ValueError: shapes differ, or the labels are all True or all False.
    """
    from sklearn.metrics import roc_auc_score

    if labels.shape != scores.shape:
        raise HeadsteerValueError(f"labels {tuple(labels.shape)} and scores {tuple(scores.shape)} differ")
    if bool(labels.all()) or not bool(labels.any()):
        raise HeadsteerValueError("labels must hold both known and other edges")
    return float(roc_auc_score(labels.numpy(), torch.nan_to_num(scores.abs(), nan=0.0).numpy()))


def activation_patching_edge_scores(kc: KnownCircuit) -> torch.Tensor:
    """`[E]` edge scores from activation patching (noising, per-pair normalised): an edge u -> v
    scores |effect(u's output)| x |effect(v's q / k / v input, or MLP output)|, the input and the
    logits counting 1 (a node method scores nodes; this is its best guess at the edges)."""
    from heads.engine.options import SweepOptions
    from heads.scorers.circuits import graph_of
    from heads.scorers.patching.activation import patch

    m, p = kc.model, kc.pairs
    g = graph_of(m)

    def effect(kind: str) -> torch.Tensor:
        r = patch(m, p, kind, direction="noising", options=SweepOptions(progress=False))
        out = r.mean.abs().nan_to_num(0.0)
        return out.amax(-1) if out.ndim == 2 and kind == "mlp_out" else out

    head, qs, ks, vs, mlp = (effect(k) for k in ("head_out", "q", "k", "v", "mlp_out"))
    src = torch.ones(g.n_upstream)
    dst = torch.ones(g.n_downstream)
    for la in range(g.n_layers):
        for h in range(g.n_heads):
            src[g.head_node(la, h)] = head[la, h]
            dst[g.q_input(la, h)] = qs[la, h]
        for kv in range(g.n_kv_heads):
            dst[g.k_input(la, kv)] = ks[la, kv]
            dst[g.v_input(la, kv)] = vs[la, kv]
        src[g.mlp_node(la)] = mlp[la]
        dst[g.mlp_input(la)] = mlp[la]
    full = src[:, None] * dst[None, :]
    return full[g.valid]


def recovery(kc: KnownCircuit, methods: tuple[str, ...] = ("eap", "eap-ig", "exact", "activation")) -> dict:
    """`{method: ROC-AUC}` of recovering `kc`'s known edges (`recovery_auc`) by each method:
    `"eap"`, `"eap-ig"` (5 steps), `"exact"` edge patching, `"activation"` patching.

    Raises:
        ValueError: an unknown method.
    """
    from heads.engine.options import SweepOptions
    from heads.scorers.circuits import edge_scores

    bad = [x for x in methods if x not in ("eap", "eap-ig", "exact", "activation")]
    if bad:
        raise HeadsteerValueError(
            f"unknown recovery method {short_repr(bad[0])}: use eap, eap-ig, exact, activation"
        )
    labels = kc.labels()
    out = {}
    for name in methods:
        if name == "activation":
            s = activation_patching_edge_scores(kc)
        else:
            s = edge_scores(kc.model, kc.pairs, method=name, options=SweepOptions(progress=False)).values()
        out[name] = recovery_auc(labels, s)
    return out

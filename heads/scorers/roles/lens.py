"""Attention Lens: one trained map per head from its output to the vocabulary (Sakarvadia et al.
2023, arXiv:2310.16270), in the tuned-lens form by default (Belrose et al. 2023, arXiv:2303.08112).

Head (l, h) writes `o_h(t) = z_h(t) W_O^h` (`[D]`) into the residual stream at position t. Its
lens reads that contribution as next-token logits:

* `form="tuned"` (default): `logits_h(t) = norm_f(A_h o_h(t) + b_h) W_U`, A_h `[D, D]`
  initialised to the identity and b_h to 0, `norm_f` and `W_U` the model's own final norm and
  unembedding (frozen). Untrained (A = I) it is the "direct" projection of the head's output.
* `form="full"`: the paper's lens, `logits_h(t) = o_h(t) W_h + c_h`, W_h `[D, V]` initialised
  from `W_U`, c_h = 0. At V = 49,152 that is 28 M parameters a head (7.6 G for SmolLM2's 270
  heads), so it is offered for a few heads (`MAX_FULL_HEADS`). The paper's code also sums the
  lenses of a layer's heads and trains on the last position only; here every head has its own
  lens and every real position is a training example.

Training minimises `KL(p_model(t) || softmax(logits_h(t)))` (the model's own next-token
distribution as the target, the paper's loss) with Adam over the positions of a text corpus,
seeded; positions are split into train and held-out sets once (`held_out` share, by whole
texts); after each epoch the held-out KL of every head is measured and its best state kept;
training stops when no head improved for `patience` epochs. With `checkpoint=` the state
(lens, Adam moments, epoch, best states, history) is written after every epoch and a later
call with the same path resumes from it (same result as an uninterrupted run: the shuffle of
epoch e is seeded by (seed, e)).

Files: safetensors with a JSON header (`metadata["headsteer"]`: schema, model name and
geometry, heads, form, training parameters, held-out KL) written atomically through
`heads._util.files`; `AttentionLens.load(path, model)` refuses a file made for another model.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from heads._util.files import check_output, write_bytes
from heads._util.progress import ProgressArg, progress_callback
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit
from heads.engine.forward import forward
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import encode_prompts
from heads.inputs.tokens import readable_token, readable_tokens
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSet, HeadSpec

__all__ = ["LENS_SCHEMA", "MAX_FULL_HEADS", "AttentionLens", "LensData", "collect_lens_data", "train_lens"]

LENS_SCHEMA = "headsteer/attention-lens"
LENS_SCHEMA_VERSION = 1
MAX_FULL_HEADS = 8
"""Most heads a `form="full"` lens may hold (each is a `[D, V]` map)."""

Form = Literal["tuned", "full"]


class _Z(HeadOutputEdit):
    """Records the chosen heads' outputs z `[B, T, n, d]` (returns z unchanged)."""

    def __init__(self, layer: int, heads: list[int]):
        super().__init__(layer=layer)
        self.want = heads
        self.z: list[torch.Tensor] = []

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        self.z.append(z[:, :, self.want].detach().float())
        return z


@dataclass
class LensData:
    """Training material of a lens: head outputs and the model's next-token logits.

    Attributes:
        heads: the `(layer, head)` pairs, in order.
        outputs: `[n_heads, N, D]` fp32 head contributions o_h at N real positions.
        target_logits: `[N, V]` fp16 model logits at those positions.
        text_index: `[N]` long, the corpus text of each position (for the split).
        token_ids: `[N]` long, the token at each position.
    """

    heads: list[tuple[int, int]]
    outputs: torch.Tensor
    target_logits: torch.Tensor
    text_index: torch.Tensor
    token_ids: torch.Tensor


def _texts(texts: object) -> list[str]:
    if isinstance(texts, str):
        texts = [texts]
    if (
        not isinstance(texts, Sequence)
        or not texts
        or not all(isinstance(t, str) and t.strip() for t in texts)
    ):
        raise HeadsteerValueError("texts must be a non-empty list of non-empty strings")
    return list(texts)


def _heads(model: HeadModel, heads: HeadSpec | None) -> list[tuple[int, int]]:
    if heads is None:
        return [(la, h) for la in range(model.n_layers) for h in range(model.n_heads)]
    hs = list(HeadSet.parse(heads, model.n_layers, model.n_heads))
    if not hs:
        raise HeadsteerValueError("no heads to train a lens for")
    return hs


@torch.no_grad()
def collect_lens_data(
    model: HeadModel,
    texts: Sequence[str],
    heads: HeadSpec | None = None,
    *,
    max_positions: int = 4096,
    batch_size: int = 8,
) -> LensData:
    """Head outputs and model logits on `texts` (plain, no chat template), real positions only,
    at most `max_positions` (the first ones, in text order).

    Raises:
        ValueError: empty texts, unknown heads, a model without a tokenizer.
    """
    if model.tokenizer is None:
        raise HeadsteerValueError("collect_lens_data needs a HeadModel with a tokenizer")
    texts = _texts(texts)
    hs = _heads(model, heads)
    by_layer: dict[int, list[int]] = {}
    for la, h in hs:
        by_layer.setdefault(la, []).append(h)
    outs, logits, tidx, toks = [], [], [], []
    n = 0
    for start in range(0, len(texts), batch_size):
        if n >= max_positions:
            break
        chunk = texts[start : start + batch_size]
        enc = encode_prompts(model.tokenizer, chunk, chat=False, markup=False)
        recs = {la: _Z(la, h) for la, h in by_layer.items()}
        with editing(model, list(recs.values())):
            lg = forward(model, enc)  # [B, T, V]
        real = enc.attention_mask.bool()
        per_head = []
        for la, h in hs:
            z = recs[la].z[0][:, :, recs[la].want.index(h)]  # [B, T, d]
            w_o = model.layer_weights(la)["W_O"][h].float()  # [d, D]
            per_head.append((z.to(w_o.device) @ w_o)[real.to(w_o.device)].cpu())  # [n, D]
        outs.append(torch.stack(per_head))
        logits.append(lg[real.to(lg.device)].to(torch.float16).cpu())
        tidx.append(torch.arange(start, start + len(chunk))[:, None].expand_as(real)[real])
        toks.append(enc.input_ids[real])
        n += int(real.sum())
    o = torch.cat(outs, 1)[:, :max_positions]
    return LensData(
        hs,
        o,
        torch.cat(logits)[:max_positions],
        torch.cat(tidx)[:max_positions],
        torch.cat(toks)[:max_positions],
    )


@dataclass
class AttentionLens:
    """Trained lenses of some heads of one model (see the module docstring).

    Attributes:
        heads: the `(layer, head)` pairs, in order.
        form: `"tuned"` (A `[n, D, D]`, b `[n, D]`) or `"full"` (W `[n, D, V]`, c `[n, V]`).
        weight, bias: the parameters, one slice per head.
        model: the model's name; geometry: `(n_layers, n_heads, d_model, d_vocab)`.
        params: training parameters; history: per epoch `{"epoch", "train_kl", "held_out_kl"}`.
        held_out_kl / untrained_kl: `[n]` final held-out KL (nats) of the lens and of the
            untrained lens (NaN before training).
    """

    heads: list[tuple[int, int]]
    form: Form
    weight: torch.Tensor
    bias: torch.Tensor
    model: str
    geometry: tuple[int, int, int, int]
    params: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    held_out_kl: torch.Tensor | None = None
    untrained_kl: torch.Tensor | None = None

    # ----------------------------------------------------------------- building
    @classmethod
    def init(cls, model: HeadModel, heads: HeadSpec | None = None, *, form: Form = "tuned") -> AttentionLens:
        """Untrained lenses: A = I, b = 0 (`"tuned"`) or W = W_U, c = 0 (`"full"`).

        Raises:
            ValueError: unknown form or heads; a `"full"` lens of more than `MAX_FULL_HEADS` heads.
        """
        if form not in ("tuned", "full"):
            raise HeadsteerValueError(f"form must be 'tuned' or 'full', got {form!r}")
        hs = _heads(model, heads)
        n, D, V = len(hs), model.d_model, model.d_vocab
        if form == "full" and n > MAX_FULL_HEADS:
            raise HeadsteerValueError(
                f"a full d_model x |V| lens is {D * V / 1e6:.0f} M parameters a head; {n} heads asked, "
                f"at most {MAX_FULL_HEADS} (use form='tuned' for many heads)"
            )
        if form == "tuned":
            w = torch.eye(D).repeat(n, 1, 1)
            b = torch.zeros(n, D)
        else:
            w = model.W_U.float().cpu().repeat(n, 1, 1)
            b = torch.zeros(n, V)
        return cls(hs, form, w, b, model.name, _geometry(model))

    def check_model(self, model: HeadModel) -> None:
        """Raise `ValueError` unless `model` is the model the lens was made for (name and geometry)."""
        if model.name != self.model or _geometry(model) != self.geometry:
            raise HeadsteerValueError(
                f"this lens was made for {self.model!r} {self.geometry} (n_layers, n_heads, d_model, "
                f"d_vocab); the model is {model.name!r} {_geometry(model)}"
            )

    # ----------------------------------------------------------------- applying
    def logits(self, model: HeadModel, outputs: torch.Tensor, *, trained: bool = True) -> torch.Tensor:
        """Lens logits `[n, N, V]` of head contributions `outputs` `[n, N, D]` (one slice per head of
        `self.heads`); `trained=False` uses the untrained lens."""
        w, b = (self.weight, self.bias) if trained else _untrained(self, model)
        return _apply(model, self.form, w.to(outputs.device), b.to(outputs.device), outputs)

    def kl(self, model: HeadModel, data: LensData, *, trained: bool = True, chunk: int = 256) -> torch.Tensor:
        """`[n]` mean KL(p_model || p_lens) (nats) per head over `data`'s positions."""
        self.check_model(model)
        idx = [data.heads.index(h) for h in self.heads]
        total = torch.zeros(len(self.heads), dtype=torch.float64)
        n = data.outputs.shape[1]
        with torch.no_grad():
            for a in range(0, n, chunk):
                o = data.outputs[idx, a : a + chunk].to(model.device)
                t = data.target_logits[a : a + chunk].to(model.device).float()
                total += _kl(self.logits(model, o, trained=trained), t).sum(-1).double().cpu()
        return (total / max(n, 1)).float()

    def top_tokens(self, model: HeadModel, text: str, layer: int, head: int, *, k: int = 5):
        """Top-`k` lens tokens of head (layer, head) at every position of `text` (plain), beside those of
        the untrained lens and the model's own prediction.

        Returns:
            DataFrame `position, token, lens_tokens, untrained_tokens, model_tokens` (readable text).

        Raises:
            ValueError: the head has no lens here; another model; bad `k`.
        """
        import pandas as pd

        self.check_model(model)
        if (layer, head) not in self.heads:
            raise HeadsteerValueError(f"no lens for head ({layer}, {head}); this lens has {self.heads}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= model.d_vocab:
            raise HeadsteerValueError(f"k must be an int in 1..{model.d_vocab}, got {k!r}")
        data = collect_lens_data(model, [text], [(layer, head)])
        i = self.heads.index((layer, head))
        sub = AttentionLens(
            [(layer, head)],
            self.form,
            self.weight[i : i + 1],
            self.bias[i : i + 1],
            self.model,
            self.geometry,
        )
        o = data.outputs.to(model.device)
        with torch.no_grad():
            lens = sub.logits(model, o)[0].topk(k, -1).indices.cpu()
            raw = sub.logits(model, o, trained=False)[0].topk(k, -1).indices.cpu()
        own = data.target_logits.float().topk(k, -1).indices
        tok = model.tokenizer
        words = readable_tokens(tok, data.token_ids)

        def names(ids: torch.Tensor) -> list[str]:
            return [readable_token(tok, int(t)) for t in ids]

        return pd.DataFrame(
            {
                "position": range(len(words)),
                "token": words,
                "lens_tokens": [names(r) for r in lens],
                "untrained_tokens": [names(r) for r in raw],
                "model_tokens": [names(r) for r in own],
            }
        )

    def kl_scores(self, which: Literal["lens", "untrained", "ratio"] = "lens") -> HeadScores:
        """Held-out KL per head as `HeadScores` `[L, H]` (NaN for heads without a lens): the
        trained lens, the untrained one, or their ratio (lens / untrained; < 1 = the lens helps)."""
        if self.held_out_kl is None or self.untrained_kl is None:
            raise HeadsteerValueError("this lens has no held-out KL yet: train it first")
        vals = {
            "lens": self.held_out_kl,
            "untrained": self.untrained_kl,
            "ratio": self.held_out_kl / self.untrained_kl.clamp(min=1e-12),
        }
        if which not in vals:
            raise HeadsteerValueError(f"which must be 'lens', 'untrained' or 'ratio', got {which!r}")
        L, H = self.geometry[0], self.geometry[1]
        s = torch.full((L, H), math.nan)
        for (la, h), v in zip(self.heads, vals[which].tolist(), strict=True):
            s[la, h] = v
        return HeadScores(s, f"lens_kl_{which}", {"form": self.form}, model=self.model)

    # ----------------------------------------------------------------- files
    def _header(self) -> dict:
        return {
            "schema": LENS_SCHEMA,
            "schema_version": LENS_SCHEMA_VERSION,
            "model": self.model,
            "geometry": list(self.geometry),
            "heads": [list(h) for h in self.heads],
            "form": self.form,
            "params": self.params,
            "history": self.history,
        }

    def _tensors(self) -> dict[str, torch.Tensor]:
        t = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        if self.held_out_kl is not None and self.untrained_kl is not None:
            t["held_out_kl"], t["untrained_kl"] = (
                self.held_out_kl.contiguous(),
                self.untrained_kl.contiguous(),
            )
        return t

    def save(self, path: str | os.PathLike, *, overwrite: bool = False, extra: dict | None = None) -> Path:
        """Write safetensors with the JSON header in its metadata, atomically; returns the path.

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
        """
        from safetensors.torch import save

        check_output(path, overwrite)
        tensors = {**self._tensors(), **(extra or {})}
        data = save(tensors, metadata={"headsteer": json.dumps(self._header())})
        return write_bytes(path, data, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> AttentionLens:
        """Read a lens file; with `model`, refuse one made for another model.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a headsteer lens file, another schema version, or another model.
        """
        lens, _ = _read(path)
        if model is not None:
            lens.check_model(model)
        return lens

    def __repr__(self) -> str:
        kl = ""
        if self.held_out_kl is not None and self.untrained_kl is not None:
            r = (self.held_out_kl / self.untrained_kl.clamp(min=1e-12)).median().item()
            kl = f", median held-out KL ratio {r:.3f}"
        return f"AttentionLens({self.model!r}, {len(self.heads)} heads, form={self.form!r}{kl})"


def _geometry(model: HeadModel) -> tuple[int, int, int, int]:
    return (model.n_layers, model.n_heads, model.d_model, model.d_vocab)


def _read(path: str | os.PathLike) -> tuple[AttentionLens, dict[str, torch.Tensor]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"lens file not found: {str(path)!r}")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(p))
        header = json.loads(meta.get("headsteer", "null"))
    except Exception as err:  # safetensors raises its own error types
        raise HeadsteerValueError(f"{str(path)!r} is not a headsteer lens file: {err}") from None
    if not isinstance(header, dict) or header.get("schema") != LENS_SCHEMA:
        raise HeadsteerValueError(f"{str(path)!r} is not a headsteer lens file")
    if header.get("schema_version") != LENS_SCHEMA_VERSION:
        raise HeadsteerValueError(
            f"{str(path)!r} has lens schema_version {header.get('schema_version')!r}; this headsteer reads "
            f"{LENS_SCHEMA_VERSION}"
        )
    lens = AttentionLens(
        [(int(h[0]), int(h[1])) for h in header["heads"]],
        header["form"],
        tensors.pop("weight"),
        tensors.pop("bias"),
        header["model"],
        tuple(int(x) for x in header["geometry"]),  # type: ignore[arg-type]
        header.get("params", {}),
        header.get("history", []),
        tensors.pop("held_out_kl", None),
        tensors.pop("untrained_kl", None),
    )
    return lens, tensors


def _untrained(lens: AttentionLens, model: HeadModel) -> tuple[torch.Tensor, torch.Tensor]:
    init = AttentionLens.init(model, lens.heads, form=lens.form)
    return init.weight, init.bias


def _apply(model: HeadModel, form: str, w: torch.Tensor, b: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Lens logits `[n, N, V]` from o `[n, N, D]` and per-head parameters."""
    if form == "tuned":
        x = torch.baddbmm(b[:, None, :], o, w)  # [n, N, D]
        x = model.final_norm(x.to(model.dtype)).float()
        return x @ model.W_U.float().to(x.device)
    return torch.baddbmm(b[:, None, :], o, w)


def _kl(lens_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """`[n, N]` KL(p_target || p_lens) per position, target `[N, V]`."""
    lt = torch.log_softmax(target_logits, -1)
    ll = torch.log_softmax(lens_logits, -1)
    return (lt.exp()[None] * (lt[None] - ll)).sum(-1)


def _check_int(v: object, what: str, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise HeadsteerValueError(f"{what} must be an int >= {lo}, got {v!r}")
    return int(v)


def train_lens(
    model: HeadModel,
    texts: Sequence[str] | LensData,
    heads: HeadSpec | None = None,
    *,
    form: Form = "tuned",
    epochs: int = 10,
    lr: float = 1e-3,
    batch_positions: int = 128,
    held_out: float = 0.2,
    patience: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
    checkpoint: str | os.PathLike | None = None,
    progress: ProgressArg = True,
) -> AttentionLens:
    """Train Attention Lenses for `heads` (default every head) on `texts` (see the module docstring).

    Args:
        texts: a text corpus (plain strings; e.g. `probes.datasets.corpus.load_corpus()`) or
            `LensData` already collected for these heads.
        form: `"tuned"` (default) or `"full"` (at most `MAX_FULL_HEADS` heads).
        epochs: most passes over the training positions (default 10).
        lr: Adam learning rate (default 1e-3).
        batch_positions: positions per Adam step (all heads step together, each its own lens).
        held_out: share of the texts kept out for early stopping and the reported KL (default 0.2).
        patience: epochs without a held-out improvement of any head before stopping (default 2).
        max_positions: real token positions collected from the corpus (default 4096).
        seed: seeds the split and every epoch's shuffle.
        checkpoint: a file to write after each epoch and to resume from when it exists.
        progress: True (a tqdm bar), False / None, or `progress(done, total)` in epochs.

    Returns:
        AttentionLens with the best held-out state of every head, `held_out_kl`, `untrained_kl`,
        and `history`; `params["seconds"]` holds the training time.

    Raises:
        ValueError: bad arguments (before any forward), fewer than 2 texts, or a checkpoint of
            another model, heads or form.
    """
    form_ok = form in ("tuned", "full")
    if not form_ok:
        raise HeadsteerValueError(f"form must be 'tuned' or 'full', got {form!r}")
    epochs = _check_int(epochs, "epochs")
    batch_positions = _check_int(batch_positions, "batch_positions")
    patience = _check_int(patience, "patience")
    max_positions = _check_int(max_positions, "max_positions", 2)
    seed = _check_int(seed, "seed", 0)
    for name, v, lo, hi in (("lr", lr, 0.0, math.inf), ("held_out", held_out, 0.0, 1.0)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (lo < v < hi):
            raise HeadsteerValueError(f"{name} must be a number in ({lo}, {hi}), got {v!r}")
    lens = AttentionLens.init(model, heads, form=form)
    if isinstance(texts, LensData):
        missing = [h for h in lens.heads if h not in texts.heads]
        if missing:
            raise HeadsteerValueError(f"the LensData lacks heads {missing}")
        data = texts
        n_texts = int(data.text_index.max()) + 1
    else:
        corpus = _texts(texts)
        n_texts = len(corpus)
        if n_texts < 2:
            raise HeadsteerValueError("a lens needs at least 2 texts (train and held-out)")
        data = collect_lens_data(model, corpus, lens.heads, max_positions=max_positions)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_texts, generator=g)
    n_held = min(max(1, round(held_out * n_texts)), n_texts - 1)
    held_texts = order[:n_held]
    is_held = torch.isin(data.text_index, held_texts)
    idx = [data.heads.index(h) for h in lens.heads]
    o_all = data.outputs[idx]
    train = LensData(
        lens.heads,
        o_all[:, ~is_held],
        data.target_logits[~is_held],
        data.text_index[~is_held],
        data.token_ids[~is_held],
    )
    held = LensData(
        lens.heads,
        o_all[:, is_held],
        data.target_logits[is_held],
        data.text_index[is_held],
        data.token_ids[is_held],
    )
    if train.outputs.shape[1] == 0 or held.outputs.shape[1] == 0:
        raise HeadsteerValueError("the train / held-out split left one side without positions: add texts")
    dev = model.device
    w = torch.nn.Parameter(lens.weight.clone().to(dev))
    b = torch.nn.Parameter(lens.bias.clone().to(dev))
    opt = torch.optim.Adam([w, b], lr=float(lr))
    start_epoch, history = 0, []
    untrained = lens.kl(model, held, trained=False)
    best = untrained.clone()
    best_w, best_b = lens.weight.clone(), lens.bias.clone()
    stale = 0
    params = {
        "form": form,
        "epochs": epochs,
        "lr": float(lr),
        "batch_positions": batch_positions,
        "held_out": float(held_out),
        "patience": patience,
        "max_positions": max_positions,
        "seed": seed,
        "n_train_positions": int(train.outputs.shape[1]),
        "n_held_out_positions": int(held.outputs.shape[1]),
    }
    if checkpoint is not None and Path(checkpoint).is_file():
        ck, extra = _read(checkpoint)
        if (
            ck.model != lens.model
            or ck.geometry != lens.geometry
            or ck.heads != lens.heads
            or ck.form != form
        ):
            raise HeadsteerValueError(f"checkpoint {str(checkpoint)!r} is for other heads, form or model")
        state = ck.params.get("state", {})
        start_epoch, stale, history = int(state["epoch"]), int(state["stale"]), list(ck.history)
        with torch.no_grad():
            w.copy_(extra["current_weight"].to(dev))
            b.copy_(extra["current_bias"].to(dev))
        best_w, best_b, best = ck.weight, ck.bias, extra["best_kl"]
        opt.load_state_dict(
            {
                "state": {
                    0: {
                        "step": extra["adam_step"].clone(),
                        "exp_avg": extra["m_w"].to(dev),
                        "exp_avg_sq": extra["v_w"].to(dev),
                    },
                    1: {
                        "step": extra["adam_step"].clone(),
                        "exp_avg": extra["m_b"].to(dev),
                        "exp_avg_sq": extra["v_b"].to(dev),
                    },
                },
                "param_groups": opt.state_dict()["param_groups"],
            }
        )
    n_train = train.outputs.shape[1]
    with progress_callback(progress, "attention lens", "epochs") as report:
        if report is not None:
            report(start_epoch, epochs)
        for epoch in range(start_epoch, epochs):
            if stale >= patience:
                break
            perm = torch.randperm(
                n_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch + 1)
            )
            total = 0.0
            for a in range(0, n_train, batch_positions):
                sel = perm[a : a + batch_positions]
                o = train.outputs[:, sel].to(dev)
                t = train.target_logits[sel].to(dev).float()
                loss = (
                    _kl(_apply(model, form, w, b, o), t).mean(-1).sum()
                )  # sum over heads: independent lenses
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item() * len(sel)
            cur = AttentionLens(
                lens.heads, form, w.detach().cpu(), b.detach().cpu(), lens.model, lens.geometry
            )
            kl = cur.kl(model, held)
            better = kl < best
            best = torch.where(better, kl, best)
            best_w[better], best_b[better] = cur.weight[better], cur.bias[better]
            stale = 0 if bool(better.any()) else stale + 1
            history.append(
                {
                    "epoch": epoch + 1,
                    "train_kl": total / n_train / len(lens.heads),
                    "held_out_kl": float(kl.mean()),
                }
            )
            if checkpoint is not None:
                st = opt.state_dict()["state"]
                ck = AttentionLens(
                    lens.heads,
                    form,
                    best_w,
                    best_b,
                    lens.model,
                    lens.geometry,
                    {**params, "state": {"epoch": epoch + 1, "stale": stale}},
                    history,
                )
                ck.save(
                    checkpoint,
                    overwrite=True,
                    extra={
                        "current_weight": cur.weight,
                        "current_bias": cur.bias,
                        "best_kl": best,
                        "adam_step": st[0]["step"].cpu(),
                        "m_w": st[0]["exp_avg"].cpu(),
                        "v_w": st[0]["exp_avg_sq"].cpu(),
                        "m_b": st[1]["exp_avg"].cpu(),
                        "v_b": st[1]["exp_avg_sq"].cpu(),
                    },
                )
            if report is not None:
                report(epoch + 1, epochs)
    params["seconds"] = time.perf_counter() - t0
    params["epochs_run"] = len(history)
    return AttentionLens(
        lens.heads, form, best_w, best_b, lens.model, lens.geometry, params, history, best.clone(), untrained
    )

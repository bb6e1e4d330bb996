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
`heads._util.files`; `AttentionLens.load(path, model)` refuses a file made for another model, and
any file whose header or tensors do not hold together (heads outside the geometry, shapes of
another form or head count, NaN / inf weights).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from heads._util.files import check_output, write_bytes
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import (
    check_bool,
    check_int,
    check_number,
    check_path,
    check_seed,
    is_int,
    parse_json,
    short_repr,
)
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit
from heads.engine.forward import forward
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import encode_prompts
from heads.inputs.tokens import readable_token, readable_tokens
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSet, HeadSpec

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "LENS_SCHEMA",
    "MAX_EPOCHS",
    "MAX_FULL_HEADS",
    "MAX_LR",
    "AttentionLens",
    "LensData",
    "collect_lens_data",
    "train_lens",
]

LENS_SCHEMA = "headsteer/attention-lens"
LENS_SCHEMA_VERSION = 1
MAX_FULL_HEADS = 8
"""Most heads a `form="full"` lens may hold (each is a `[D, V]` map)."""
MAX_LR = 1.0
"""Largest Adam learning rate `train_lens` accepts (a larger step only diverges)."""
MAX_EPOCHS = 100_000
"""Most epochs `train_lens` accepts."""

_RESERVED = ("weight", "bias", "held_out_kl", "untrained_kl")
"""Tensor names of a lens file that `AttentionLens.save(extra=...)` may not use."""

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

    Args:
        texts: a text or a non-empty list of non-empty texts.
        heads: a head selection (`HeadSet.parse`; default every head).
        max_positions: positions kept (a positive int, default 4096).
        batch_size: texts per forward (a positive int, default 8).

    Returns:
        `LensData`: outputs `[n, N, D]` fp32, target logits `[N, V]` fp16, N <= `max_positions`.

    Raises:
        HeadsteerValueError: empty texts, unknown heads, a model without a tokenizer, bad
            `max_positions` or `batch_size` (all before the first forward).
    """
    if model.tokenizer is None:
        raise HeadsteerValueError("collect_lens_data needs a HeadModel with a tokenizer")
    texts = _texts(texts)
    max_positions = check_int("max_positions", max_positions, lo=1)
    batch_size = check_int("batch_size", batch_size, lo=1)
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

        Args:
            heads: a head selection (`HeadSet.parse`: pairs, "L.H" strings, a file; default every head).
            form: `"tuned"` (weight `[n, D, D]` = I, bias `[n, D]` = 0) or `"full"` (weight
                `[n, D, V]` = W_U, bias `[n, V]` = 0).

        Raises:
            HeadsteerValueError: unknown form or heads; a `"full"` lens of more than
                `MAX_FULL_HEADS` heads.
        """
        _check_form(form)
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
        """Raise `HeadsteerValueError` unless `model` is the model the lens was made for (name and
        geometry `(n_layers, n_heads, d_model, d_vocab)`); `HeadsteerTypeError` for a non-model."""
        if not isinstance(model, HeadModel):
            raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
        if model.name != self.model or _geometry(model) != self.geometry:
            raise HeadsteerValueError(
                f"this lens was made for {short_repr(self.model)} {self.geometry} (n_layers, n_heads, "
                f"d_model, d_vocab); the model is {short_repr(model.name)} {_geometry(model)}"
            )

    # ----------------------------------------------------------------- applying
    def logits(self, model: HeadModel, outputs: torch.Tensor, *, trained: bool = True) -> torch.Tensor:
        """Lens logits `[n, N, V]` of head contributions `outputs` `[n, N, D]` (one slice per head of
        `self.heads`); `trained=False` uses the untrained lens.

        Raises:
            HeadsteerValueError: another model; `outputs` not a float `[n, N, D]` tensor.
            HeadsteerTypeError: `trained` not a bool.
        """
        self.check_model(model)
        check_bool("trained", trained)
        n, D = len(self.heads), self.geometry[2]
        if (
            not isinstance(outputs, torch.Tensor)
            or not outputs.dtype.is_floating_point
            or outputs.ndim != 3
            or outputs.shape[0] != n
            or outputs.shape[2] != D
        ):
            got = f"{tuple(outputs.shape)} {outputs.dtype}" if isinstance(outputs, torch.Tensor) else outputs
            raise HeadsteerValueError(f"outputs must be a float [{n}, N, {D}] tensor, got {short_repr(got)}")
        w, b = (self.weight, self.bias) if trained else _untrained(self, model)
        return _apply(model, self.form, w.to(outputs.device), b.to(outputs.device), outputs)

    def kl(self, model: HeadModel, data: LensData, *, trained: bool = True, chunk: int = 256) -> torch.Tensor:
        """`[n]` mean KL(p_model || p_lens) (nats) per head over `data`'s positions.

        Raises:
            HeadsteerValueError: another model; `data` lacks a head of the lens; bad `chunk`.
            HeadsteerTypeError: `data` not `LensData`, `trained` not a bool.
        """
        self.check_model(model)
        check_bool("trained", trained)
        chunk = check_int("chunk", chunk, lo=1)
        _check_data(model, data, self.heads)
        idx = [data.heads.index(h) for h in self.heads]
        total = torch.zeros(len(self.heads), dtype=torch.float64)
        n = data.outputs.shape[1]
        with torch.no_grad():
            for a in range(0, n, chunk):
                o = data.outputs[idx, a : a + chunk].to(model.device)
                t = data.target_logits[a : a + chunk].to(model.device).float()
                total += _kl(self.logits(model, o, trained=trained), t).sum(-1).double().cpu()
        return (total / max(n, 1)).float()

    def top_tokens(self, model: HeadModel, text: str, layer: int, head: int, *, k: int = 5) -> pd.DataFrame:
        """Top-`k` lens tokens of head (layer, head) at every position of `text` (plain), beside those of
        the untrained lens and the model's own prediction.

        Returns:
            DataFrame `position, token, lens_tokens, untrained_tokens, model_tokens` (readable text).

        Args:
            text: a non-empty text (encoded plainly, no chat template).
            layer, head: a head of this lens (ints, numpy ints too; never bools).
            k: tokens per position, 1..d_vocab (default 5).

        Raises:
            HeadsteerValueError: the head has no lens here or is not a head of the model; another
                model; bad `k` or `text`.
            HeadsteerTypeError: `layer` / `head` not ints.
        """
        import pandas as pd

        self.check_model(model)
        model.check_head(layer, head)
        layer, head = int(layer), int(head)
        if (layer, head) not in self.heads:
            raise HeadsteerValueError(f"no lens for head ({layer}, {head}); this lens has {self.heads}")
        k = check_int("k", k, lo=1, hi=model.d_vocab)
        if not isinstance(text, str) or not text.strip():
            raise HeadsteerValueError(f"text must be a non-empty string, got {short_repr(text)}")
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
        trained lens, the untrained one, or their ratio (lens / untrained; < 1 = the lens helps).

        Raises:
            HeadsteerValueError: unknown `which`; a lens without held-out KL (not trained).
        """
        if not isinstance(which, str) or which not in ("lens", "untrained", "ratio"):
            raise HeadsteerValueError(
                f"which must be 'lens', 'untrained' or 'ratio', got {short_repr(which)}"
            )
        if self.held_out_kl is None or self.untrained_kl is None:
            raise HeadsteerValueError("this lens has no held-out KL yet: train it first")
        vals = {
            "lens": self.held_out_kl,
            "untrained": self.untrained_kl,
            "ratio": self.held_out_kl / self.untrained_kl.clamp(min=1e-12),
        }
        if which not in vals:
            raise HeadsteerValueError(
                f"which must be 'lens', 'untrained' or 'ratio', got {short_repr(which)}"
            )
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

    def save(
        self,
        path: str | os.PathLike,
        *,
        overwrite: bool = False,
        extra: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write safetensors with the JSON header in its metadata, atomically; returns the path.

        Args:
            path: the file (str or path-like).
            overwrite: replace an existing file (default False).
            extra: more tensors to store beside the lens (`{name: tensor}`; names other than
                `weight`, `bias`, `held_out_kl`, `untrained_kl`), read back by `_read`.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, or is a symlink or a
                folder; an `extra` name that is reserved or empty.
            HeadsteerTypeError: `path` not a path, `overwrite` not a bool, `extra` not a mapping
                of names to tensors.
        """
        from safetensors.torch import save

        path = check_path("path", path)
        check_bool("overwrite", overwrite)
        extra = _check_extra(extra)
        check_output(path, overwrite)
        tensors = {**self._tensors(), **extra}
        data = save(tensors, metadata={"headsteer": json.dumps(self._header())})
        return write_bytes(path, data, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> AttentionLens:
        """Read a lens file; with `model`, refuse one made for another model.

        The whole header is checked (schema and version, model name and geometry, heads inside
        that geometry and not repeated, form, at most `MAX_FULL_HEADS` full lenses) and the
        tensors against it (`weight` / `bias` present, of the form's shapes, float and finite;
        `held_out_kl` / `untrained_kl` both or neither, `[n]`), before a lens is built.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a headsteer lens file, another schema version, a tampered
                header or tensors (naming the bad field; a header that is not JSON or holds an
                integer of more than 4300 digits: `parse_json`'s one line), or another model.
            HeadsteerTypeError: `path` not a path, `model` not a `HeadModel`.
        """
        path = check_path("path", path)
        if model is not None and not isinstance(model, HeadModel):
            raise HeadsteerTypeError(f"model must be a HeadModel or None, got {type(model).__name__}")
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


def _check_form(form: object) -> str:
    if not isinstance(form, str) or form not in ("tuned", "full"):
        raise HeadsteerValueError(f"form must be 'tuned' or 'full', got {short_repr(form)}")
    return form


def _check_extra(extra: object) -> dict[str, torch.Tensor]:
    """`extra` tensors of `save`: a mapping of new, non-empty names to tensors."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise HeadsteerTypeError(f"extra must be a {{name: tensor}} mapping, got {type(extra).__name__}")
    for k, v in extra.items():
        if not isinstance(k, str) or not k.strip():
            raise HeadsteerValueError(f"extra tensor names must be non-empty strings, got {short_repr(k)}")
        if k in _RESERVED:
            raise HeadsteerValueError(
                f"extra tensor name {short_repr(k)} is reserved for the lens ({', '.join(_RESERVED)})"
            )
        if not isinstance(v, torch.Tensor):
            raise HeadsteerTypeError(
                f"extra tensor {short_repr(k)} must be a torch.Tensor, got {type(v).__name__}"
            )
    return {k: v.contiguous() for k, v in extra.items()}


def _check_data(model: HeadModel, data: object, heads: list[tuple[int, int]]) -> None:
    """`data` must be `LensData` of this model's width and vocabulary holding `heads`."""
    if not isinstance(data, LensData):
        raise HeadsteerTypeError(f"data must be LensData (collect_lens_data), got {type(data).__name__}")
    missing = [h for h in heads if h not in data.heads]
    if missing:
        raise HeadsteerValueError(f"the LensData lacks heads {missing}")
    o, t = data.outputs, data.target_logits
    n_pos = t.shape[0] if isinstance(t, torch.Tensor) and t.ndim == 2 else -1
    if (
        not isinstance(o, torch.Tensor)
        or o.ndim != 3
        or tuple(o.shape[::2]) != (len(data.heads), model.d_model)
        or n_pos != o.shape[1]
        or t.shape[1] != model.d_vocab
        or not isinstance(data.text_index, torch.Tensor)
        or tuple(data.text_index.shape) != (n_pos,)
    ):
        raise HeadsteerValueError(
            f"the LensData does not fit this model: outputs {tuple(getattr(o, 'shape', ()))}, target logits "
            f"{tuple(getattr(t, 'shape', ()))}; want [{len(data.heads)}, N, {model.d_model}] and "
            f"[N, {model.d_vocab}]"
        )


def _bad(path: str, what: str) -> HeadsteerValueError:
    return HeadsteerValueError(f"{path!r} is not a valid headsteer lens file: {what}")


def _check_header(header: dict, path: str) -> tuple[list[tuple[int, int]], str, tuple[int, int, int, int]]:
    """The heads, form and geometry of a lens header, every field checked."""
    model = header.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(path, f"model must be a non-empty name, got {short_repr(model)}")
    geo = header.get("geometry")
    if not isinstance(geo, list) or len(geo) != 4 or not all(is_int(x) and x >= 1 for x in geo):
        raise _bad(
            path,
            f"geometry must be 4 positive ints (n_layers, n_heads, d_model, d_vocab), got {short_repr(geo)}",
        )
    L, H = int(geo[0]), int(geo[1])
    heads = header.get("heads")
    if not isinstance(heads, list) or not heads:
        raise _bad(path, f"heads must be a non-empty list of [layer, head] pairs, got {short_repr(heads)}")
    hs = []
    for h in heads:
        if (
            not isinstance(h, list)
            or len(h) != 2
            or not all(is_int(x) for x in h)
            or not (0 <= h[0] < L and 0 <= h[1] < H)
        ):
            raise _bad(path, f"head {short_repr(h)} is not a [layer, head] pair of a {L} x {H} model")
        hs.append((int(h[0]), int(h[1])))
    if len(set(hs)) != len(hs):
        raise _bad(path, "a head is listed twice")
    form = header.get("form")
    if not isinstance(form, str) or form not in ("tuned", "full"):
        raise _bad(path, f"form must be 'tuned' or 'full', got {short_repr(form)}")
    if form == "full" and len(hs) > MAX_FULL_HEADS:
        raise _bad(path, f"{len(hs)} full lenses, at most {MAX_FULL_HEADS}")
    if not isinstance(header.get("params", {}), dict):
        raise _bad(path, f"params must be an object, got {short_repr(header.get('params'))}")
    history = header.get("history", [])
    if not isinstance(history, list) or not all(isinstance(x, dict) for x in history):
        raise _bad(path, "history must be a list of objects")
    return hs, form, (int(geo[0]), int(geo[1]), int(geo[2]), int(geo[3]))


def _check_tensors(
    tensors: dict[str, torch.Tensor], n: int, form: str, geometry: tuple[int, int, int, int], path: str
) -> None:
    D, V = geometry[2], geometry[3]
    want = {"weight": (n, D, D), "bias": (n, D)} if form == "tuned" else {"weight": (n, D, V), "bias": (n, V)}
    for name, shape in want.items():
        if name not in tensors:
            raise _bad(path, f"no {short_repr(name)} tensor")
        t = tensors[name]
        if tuple(t.shape) != shape or not t.dtype.is_floating_point:
            raise _bad(
                path, f"{name} is {tuple(t.shape)} {t.dtype}, a {form} lens of {n} heads needs float {shape}"
            )
        if not bool(torch.isfinite(t).all()):
            raise _bad(path, f"{name} holds NaN or inf")
    kls = [k for k in ("held_out_kl", "untrained_kl") if k in tensors]
    if len(kls) == 1:
        raise _bad(path, f"{short_repr(kls[0])} without its pair")
    for name in kls:
        t = tensors[name]
        if tuple(t.shape) != (n,) or not t.dtype.is_floating_point or not bool(torch.isfinite(t).all()):
            raise _bad(path, f"{name} must be a finite float [{n}] tensor, got {tuple(t.shape)} {t.dtype}")


def _read(path: str | os.PathLike) -> tuple[AttentionLens, dict[str, torch.Tensor]]:
    """A lens file's lens and its other tensors; the header is checked before the tensors are read."""
    from safetensors import safe_open

    p = Path(path)
    shown = str(path)
    if p.is_dir():
        raise HeadsteerValueError(f"{shown!r} is a folder, not a lens file")
    if not p.is_file():
        raise FileNotFoundError(f"lens file not found: {shown!r}")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            header = parse_json(meta.get("headsteer", "null"), f"the header of {shown!r}")
            if not isinstance(header, dict) or header.get("schema") != LENS_SCHEMA:
                raise HeadsteerValueError(f"{shown!r} is not a headsteer lens file")
            version = header.get("schema_version")
            if not is_int(version) or version != LENS_SCHEMA_VERSION:
                raise HeadsteerValueError(
                    f"{shown!r} has lens schema_version {short_repr(version)}; "
                    f"this headsteer reads {LENS_SCHEMA_VERSION}"
                )
            heads, form, geometry = _check_header(header, shown)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except HeadsteerValueError:
        raise
    except Exception as err:  # safetensors and json raise their own error types
        raise HeadsteerValueError(f"{shown!r} is not a headsteer lens file: {err}") from None
    _check_tensors(tensors, len(heads), form, geometry, shown)
    lens = AttentionLens(
        heads,
        form,  # type: ignore[arg-type]
        tensors.pop("weight"),
        tensors.pop("bias"),
        header["model"],
        geometry,
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
        logits: torch.Tensor = x @ model.W_U.float().to(x.device)
        return logits
    return torch.baddbmm(b[:, None, :], o, w)


def _kl(lens_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """`[n, N]` KL(p_target || p_lens) per position, target `[N, V]`."""
    lt = torch.log_softmax(target_logits, -1)
    ll = torch.log_softmax(lens_logits, -1)
    return (lt.exp()[None] * (lt[None] - ll)).sum(-1)


_CHECKPOINT_TENSORS = ("current_weight", "current_bias", "best_kl", "adam_step", "m_w", "v_w", "m_b", "v_b")
_RESUME_PARAMS = ("lr", "batch_positions", "held_out", "max_positions", "seed")
"""Training parameters a resumed run must share with its checkpoint (epochs and patience may differ)."""


def _read_checkpoint(
    checkpoint: str, lens: AttentionLens, params: dict
) -> tuple[AttentionLens, dict[str, torch.Tensor]]:
    """A checkpoint of `lens`'s model, heads and form, written with the same training parameters."""
    ck, extra = _read(checkpoint)
    if (
        ck.model != lens.model
        or ck.geometry != lens.geometry
        or ck.heads != lens.heads
        or ck.form != lens.form
    ):
        raise HeadsteerValueError(f"checkpoint {checkpoint!r} is for other heads, form or model")
    missing = [k for k in _CHECKPOINT_TENSORS if k not in extra]
    state = ck.params.get("state")
    if (
        missing
        or not isinstance(state, dict)
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for v in (state.get("epoch"), state.get("stale"))
        )
    ):
        raise HeadsteerValueError(
            f"checkpoint {checkpoint!r} is a lens file, not a train_lens checkpoint "
            f"(missing {missing or 'state'})"
        )
    for k in ("current_weight", "m_w", "v_w"):
        if extra[k].shape != ck.weight.shape:
            raise HeadsteerValueError(f"checkpoint {checkpoint!r}: {k} is {tuple(extra[k].shape)}")
    for k in ("current_bias", "m_b", "v_b"):
        if extra[k].shape != ck.bias.shape:
            raise HeadsteerValueError(f"checkpoint {checkpoint!r}: {k} is {tuple(extra[k].shape)}")
    if tuple(extra["best_kl"].shape) != (len(ck.heads),) or extra["adam_step"].numel() != 1:
        raise HeadsteerValueError(f"checkpoint {checkpoint!r}: best_kl or adam_step has the wrong shape")
    for k in _CHECKPOINT_TENSORS:
        if not extra[k].dtype.is_floating_point or not bool(torch.isfinite(extra[k]).all()):
            raise HeadsteerValueError(f"checkpoint {checkpoint!r}: {k} is not a finite float tensor")
    differ = [k for k in _RESUME_PARAMS if ck.params.get(k) != params[k]]
    if differ:
        raise HeadsteerValueError(
            f"checkpoint {checkpoint!r} was written with other {', '.join(differ)} "
            f"({', '.join(f'{k}={short_repr(ck.params.get(k))}' for k in differ)}): resume with the same "
            "values"
        )
    return ck, extra


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
        max_positions: real token positions collected from the corpus (default 4096, >= 2).
        seed: seeds the split and every epoch's shuffle (an int in 0..2**32 - 1, default 0).
        checkpoint: a file to write after each epoch and to resume from when it exists (the
            resumed call must use the same lr, batch_positions, held_out, max_positions, seed).
        progress: True (a tqdm bar), False / None, or `progress(done, total)` in epochs.

    Every argument is checked before any forward: `epochs` in 1..`MAX_EPOCHS`, `lr` in
    (0, `MAX_LR`], `held_out` in (0, 1), `batch_positions` and `patience` positive ints.

    Returns:
        AttentionLens with the best held-out state of every head, `held_out_kl`, `untrained_kl`,
        and `history`; `params["seconds"]` holds the training time.

    Raises:
        HeadsteerValueError: bad arguments, fewer than 2 texts, LensData of another model or
            heads, or a checkpoint of another model, heads, form or training parameters.
        HeadsteerTypeError: `progress` or `checkpoint` of a wrong type.
    """
    _check_form(form)
    epochs = check_int("epochs", epochs, lo=1, hi=MAX_EPOCHS)
    batch_positions = check_int("batch_positions", batch_positions, lo=1)
    patience = check_int("patience", patience, lo=1)
    max_positions = check_int("max_positions", max_positions, lo=2)
    seed = check_seed("seed", seed)
    lr = check_number("lr", lr, lo=0.0, hi=MAX_LR, lo_open=True)
    held_out = check_number("held_out", held_out, lo=0.0, hi=1.0, lo_open=True, what="a number in (0, 1)")
    if held_out == 1.0:
        raise HeadsteerValueError(f"held_out must be a number in (0, 1), got {short_repr(held_out)}")
    if checkpoint is not None:
        checkpoint = check_path("checkpoint", checkpoint)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise HeadsteerTypeError(
            f"progress must be True, False, None or a callable (done, total), got {type(progress).__name__}"
        )
    lens = AttentionLens.init(model, heads, form=form)
    resume_params = {
        "lr": float(lr),
        "batch_positions": batch_positions,
        "held_out": float(held_out),
        "max_positions": max_positions,
        "seed": seed,
    }
    resume = (
        _read_checkpoint(checkpoint, lens, resume_params)
        if checkpoint is not None and Path(checkpoint).is_file()
        else None
    )
    if isinstance(texts, LensData):
        _check_data(model, texts, lens.heads)
        data = texts
        if data.outputs.shape[1] == 0:
            raise HeadsteerValueError("the LensData holds no positions")
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
    if resume is not None:
        ck, extra = resume
        state = ck.params["state"]
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

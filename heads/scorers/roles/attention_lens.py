"""The `AttentionLens` object: one map per head from its output to the vocabulary, in the tuned-lens
or the full form (see `heads.scorers.roles.lens` for the method and its training), and its file.

Files: safetensors with a JSON header (`metadata["headsteer"]`: schema, model name and
geometry, heads, form, training parameters, held-out KL) written atomically through
`heads._util.files`; `AttentionLens.load(path, model)` refuses a file made for another model, and
any file whose header or tensors do not hold together (heads outside the geometry, shapes of
another form or head count, NaN / inf weights).

It follows the result protocol (`heads.results.protocol.Result`): `head_scores()` is the held-out
KL ratio per head, `to_frame()` one row per lens head, `save` / `load` as above (`SCHEMA` /
`SCHEMA_VERSION` are `LENS_SCHEMA` / `LENS_SCHEMA_VERSION`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from heads._util.files import check_output, write_bytes
from heads._util.validation import (
    check_bool,
    check_int,
    check_path,
    is_int,
    parse_json,
    short_repr,
)
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.tokens import readable_token, readable_tokens
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSpec
from heads.results.storage import check_schema_version, guarded_load
from heads.scorers.roles.lens_data import LensData, _check_data, _heads, collect_lens_data

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["LENS_SCHEMA", "LENS_SCHEMA_VERSION", "MAX_FULL_HEADS", "AttentionLens", "Form"]


LENS_SCHEMA = "headsteer/attention-lens"
LENS_SCHEMA_VERSION = 1
MAX_FULL_HEADS = 8
"""Most heads a `form="full"` lens may hold (each is a `[D, V]` map)."""


_RESERVED = ("weight", "bias", "held_out_kl", "untrained_kl")
"""Tensor names of a lens file that `AttentionLens.save(extra=...)` may not use."""

Form = Literal["tuned", "full"]


@dataclass
class AttentionLens:
    """Trained lenses of some heads of one model (see the module docstring).

    Attributes:
        heads: the `(layer, head)` pairs, in order.
        form: `"tuned"` (A `[n, D, D]`, b `[n, D]`) or `"full"` (W `[n, D, V]`, c `[n, V]`).
        weight: the weights, one slice per head.
        bias: the biases, one slice per head.
        model: the model's name; geometry: `(n_layers, n_heads, d_model, d_vocab)`.
        params: training parameters; history: per epoch `{"epoch", "train_kl", "held_out_kl"}`.
        held_out_kl: `[n]` final held-out KL (nats) of the lens (NaN before training).
        untrained_kl: `[n]` held-out KL (nats) of the untrained lens (NaN before training).
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

    SCHEMA: ClassVar[str] = LENS_SCHEMA
    SCHEMA_VERSION: ClassVar[int] = LENS_SCHEMA_VERSION

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
                f"d_model, d_vocab); the model has {short_repr(model.name)} {_geometry(model)}"
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

    def head_scores(self) -> HeadScores:
        """`[L, H]` the held-out KL ratio per head, trained lens / untrained lens (< 1: the lens
        reads the head's output better than the model's own unembedding; NaN for heads without a
        lens): `kl_scores("ratio")`, the atlas' `lens_kl_ratio` column.

        Raises:
            HeadsteerValueError: a lens without held-out KL (not trained).
        """
        return self.kl_scores("ratio")

    def to_frame(self) -> pd.DataFrame:
        """One row per lens head: `layer, head, held_out_kl, untrained_kl, kl_ratio` (nats; NaN
        before training)."""
        import pandas as pd

        n = len(self.heads)
        nan = torch.full((n,), math.nan)
        held = nan if self.held_out_kl is None else self.held_out_kl.float()
        raw = nan if self.untrained_kl is None else self.untrained_kl.float()
        return pd.DataFrame(
            {
                "layer": [la for la, _ in self.heads],
                "head": [h for _, h in self.heads],
                "held_out_kl": held.tolist(),
                "untrained_kl": raw.tolist(),
                "kl_ratio": (held / raw.clamp(min=1e-12)).tolist(),
            }
        )

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
    @guarded_load
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
            check_schema_version(shown, header.get("schema_version"), LENS_SCHEMA_VERSION, "lens")
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

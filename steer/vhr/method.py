"""VHD and VHR: vision-aware head divergence and head reinforcement (He et al., ACL 2025,
arXiv:2412.13949; docs/methods/vhr.md), for images and for a marked text context.

VHD of head i in layer l is the Euclidean distance between the head's output (its slice of
the `o_proj` input, `[d_head]`) at the last prompt position with and without the image (or
context passage): VHD_{l,i} = ||A_{l,i}(x_V, x_T) - A_{l,i}(x_T)||_2 (§2).

`Vhr` selects, per sample and per target layer, the heads strictly above the layer median of
VHD after outlier zeroing (VHD > mu + sigma *and* TA = ||A(no image)||^2 > mu + sigma, population
std), and scales their outputs by alpha at every prompt row and every decode step.

Both branches run as two rows of **one** batched prefill (docs/methods/vhr.md): row b holds sample b
with its image, row B + b the same prompt with every image token removed (left-padded to the
same length, positions counted over real tokens, so both rows end at the same query token).
A head-output edit in each target layer computes VHD from the two rows' last positions,
selects, and scales the selected heads in both rows (or only the with-image row) before the
next layer runs: VHD at layer l sees earlier layers already reinforced (Algorithm 1).
Heads are selected once per sample; decoding then scales the same heads with
`heads.engine.edits.HeadScale` (per-row head masks).

Text variant ("VHR-text"): the "image" is the emphasized context passage (`**...**` markup
or `emphasize=`); the no-context row deletes the passage's tokens.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch

from heads._util.validation import check_int, check_layer_list, check_number, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit, HeadScale
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, position_ids
from heads.model.adapter import HeadModel
from steer.span_rows import warn_rows_without_span

__all__ = [
    "Vhr",
    "VhdProbe",
    "VhrSelection",
    "default_vhr_layers",
    "measure_vhd",
    "no_span_rows",
    "probe_inputs",
    "select_heads_vhd",
    "t_vhd",
]

Target = Literal["auto", "image", "text"]
WithoutImage = Literal["delete", "mask"]


def _check_without(without_image: object) -> None:
    if without_image not in ("delete", "mask"):
        raise HeadsteerValueError(
            f"unknown without_image {short_repr(without_image)}: use 'delete' or 'mask'"
        )


def default_vhr_layers(n_layers: int) -> list[int]:
    """{1} plus the last round(14 L / 32) layers (docs/methods/vhr.md; LLaVA-1.5's {1} + 18..31 at L = 32).

    SmolLM2 (L = 30): [1, 17, ..., 29]; a 2-layer model: [1].
    """
    last = max(1, round(14 * n_layers / 32))
    out = {min(1, n_layers - 1)} | set(range(max(0, n_layers - last), n_layers))
    return sorted(out)


def select_heads_vhd(
    vhd: torch.Tensor, ta: torch.Tensor, *, outliers: bool = True, ddof: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """VHR's per-layer head selection (docs/methods/vhr.md, "Outlier removal" and "Selection").

    Args:
        vhd: `[..., H]` VHD of each head (fp32).
        ta: `[..., H]` squared norm of each head's output without the image.
        outliers: zero heads with VHD > mu + sigma and TA > mu + sigma (default True).
        ddof: 0 (population std, default) or 1 (sample std) for sigma.

    Returns:
        `(selected, zeroed_vhd)`: `[..., H]` bool, the heads strictly above the median of the
        zeroed VHD (the lower median `torch.median`: with 9 heads the 5th value, 4 selected;
        with 32 heads and no ties 16), and the zeroed VHD.
    """
    v = vhd.float()
    if outliers:

        def above(x: torch.Tensor) -> torch.Tensor:
            mu = x.mean(-1, keepdim=True)
            sd = x.std(-1, keepdim=True, correction=ddof) if x.shape[-1] > ddof else torch.zeros_like(mu)
            return x > mu + sd

        v = torch.where(above(v) & above(ta.float()), 0.0, v)
    med = v.median(-1, keepdim=True).values
    return v > med, v


def t_vhd(vhd: torch.Tensor, k: int = 4, *, reduce: Literal["sum", "mean"] = "sum") -> torch.Tensor:
    """T-VHD (analysis only, docs/methods/vhr.md): sum over layers of the top-k VHD in each layer.

    Args:
        vhd: `[..., L, H]` VHD (NaN entries, e.g. unscored layers, count as 0).
        k: heads per layer (the paper gives none; default 4).
        reduce: "sum" (ACL text, default) or "mean" (some summaries) of the top-k.

    Returns:
        `[...]` T-VHD.

    Raises:
        ValueError: k outside 1..H or an unknown reduce.
    """
    check_int("k", k, lo=1, hi=vhd.shape[-1])
    if reduce not in ("sum", "mean"):
        raise HeadsteerValueError(f"unknown reduce {short_repr(reduce)}: use 'sum' or 'mean'")
    top = torch.nan_to_num(vhd.float(), nan=0.0).topk(int(k), dim=-1).values
    per_layer = top.sum(-1) if reduce == "sum" else top.mean(-1)
    return per_layer.sum(-1)


# ----------------------------------------------------------------------------- probe batch
_MARKER_ATTRS = ("vision_start_token_id", "vision_end_token_id")


def _marker_ids(model: HeadModel) -> set[int]:
    """Token ids that only frame an image (Qwen2-VL vision start/end, Idefics3 tile markers)."""
    cfg = model.model.config
    ids = {int(getattr(cfg, a)) for a in _MARKER_ATTRS if isinstance(getattr(cfg, a, None), int)}
    proc = getattr(model, "processor", None)
    tok = getattr(proc, "tokenizer", None) or model.tokenizer
    if proc is not None and tok is not None:
        for a in ("fake_image_token", "global_image_tag", "global_image_token"):
            t = getattr(proc, a, None)
            t = getattr(t, "content", t)
            if isinstance(t, str):
                i = tok.convert_tokens_to_ids(t)
                if isinstance(i, int) and i != tok.unk_token_id:
                    ids.add(i)
        vocab = tok.get_vocab() if getattr(proc, "image_seq_len", None) is not None else {}
        ids |= {i for t, i in vocab.items() if t.startswith("<row_") and "_col_" in t}
    return ids


def no_span_rows(model: HeadModel, enc: EncodedPrompts, spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """`[B, P]` bool: the real tokens kept in the "without image / context" row of each sample.

    Every token of `spans` is dropped, and so are runs of image-framing marker tokens
    (Qwen2-VL `<|vision_start|>`/`<|vision_end|>`, Idefics3 `<fake_token_around_image>`,
    `<global-img>`, `<row_i_col_j>`) that touch a dropped span (docs/methods/vhr.md).
    """
    keep = enc.attention_mask.bool().clone()
    markers = _marker_ids(model)
    ids = enc.input_ids
    for b, row in enumerate(spans):
        for t0, t1 in row:
            keep[b, t0:t1] = False
            if markers:
                i = t0 - 1
                while i >= 0 and int(ids[b, i]) in markers:
                    keep[b, i] = False
                    i -= 1
                i = t1
                while i < ids.shape[1] and int(ids[b, i]) in markers:
                    keep[b, i] = False
                    i += 1
    return keep


def _left_pack(x: torch.Tensor, keep: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Gather the kept columns of each row of `x` `[B, P]`, left-padded with `fill` to width P."""
    out = torch.full_like(x, fill)
    for b in range(x.shape[0]):
        kept = x[b][keep[b]]
        if kept.numel():
            out[b, x.shape[1] - kept.numel() :] = kept
    return out


def probe_inputs(
    model: HeadModel,
    enc: EncodedPrompts,
    spans: list[list[tuple[int, int]]],
    without_image: WithoutImage = "delete",
) -> dict[str, torch.Tensor]:
    """Model inputs of VHR's probe batch: `2B` rows `[with image (enc's rows); without]`, width P.

    `without_image="delete"` (default, docs/methods/vhr.md): the without-image rows keep every text token
    (template included) in order, drop the image tokens (`no_span_rows`) and `pixel_values`
    for them, are left-padded to P, and get positions counted over their real tokens, so both
    rows of a sample end at index P - 1 on the same query token (docs/methods/vhr.md). For M-RoPE
    models (Qwen2-VL) positions come from the model's own `get_rope_index` on the probe
    batch: removing the image renumbers them.

    `without_image="mask"` (the spec's option): the without-image rows are copies of the
    with-image rows (same ids, images and positions) whose attention mask is 0 on the removed
    tokens, so every query gives them zero attention while no position changes.

    Raises:
        ValueError: an unknown `without_image`, or a sample whose without-image row would be
            empty.
    """
    _check_without(without_image)
    keep = no_span_rows(model, enc, spans)
    if not bool(keep.any(-1).all()):
        bad = [b for b in range(enc.batch) if not bool(keep[b].any())]
        raise HeadsteerValueError(f"prompts {bad} hold nothing but the image / context: no without-image row")
    if without_image == "mask":
        out = {
            "input_ids": torch.cat([enc.input_ids, enc.input_ids]),
            "attention_mask": torch.cat([enc.attention_mask, enc.attention_mask * keep]),
        }
        for k, v in enc.inputs.items():  # per-row and per-image tensors alike: the images repeat
            out[k] = torch.cat([v, v])
        pos = enc.position_ids()
        out["position_ids"] = torch.cat([pos, pos], dim=-2)  # [2B, P] or M-RoPE [3, 2B, P]
        return out
    pad = model.tokenizer.pad_token_id if model.tokenizer is not None else 0
    ids = torch.cat([enc.input_ids, _left_pack(enc.input_ids, keep, pad if pad is not None else 0)])
    mask = torch.cat([enc.attention_mask, _left_pack(enc.attention_mask, keep)])
    out = {"input_ids": ids, "attention_mask": mask}
    mtype = getattr(model.model.config, "model_type", "")
    for k, v in enc.inputs.items():
        if k in ("mm_token_type_ids", "token_type_ids"):
            out[k] = torch.cat([v, _left_pack(v, keep)])
        elif mtype in ("idefics3", "smolvlm", "idefics2") and v.shape[:1] == (enc.batch,):
            out[k] = torch.cat([v, torch.zeros_like(v)])  # all-zero images are dropped as padding
        else:
            out[k] = v  # per-image tensors: the without-image rows hold no image token
    if enc.mrope_position_ids is not None:
        from heads.inputs.images import _rope_index

        extra = {k: out[k] for k in ("image_grid_thw", "mm_token_type_ids") if k in out}
        pos, _ = _rope_index(model.model)(ids, attention_mask=mask, **extra)
        out["position_ids"] = pos
    else:
        out["position_ids"] = position_ids(mask)
    return out


# ----------------------------------------------------------------------------- the probe edit
@dataclass
class VhrSelection:
    """What VHR chose for one batch.

    Attributes:
        layers: the target layers, ascending.
        heads: `{layer: [B, H] bool}` selected heads per sample.
        vhd: `[B, L, H]` VHD measured in the probe pass (NaN in layers not measured).
        ta: `[B, L, H]` squared output norm without the image (NaN where not measured).
        probe_logits: `[2B, V]` last-position logits of the probe batch (rows `:B` with image).
        selections: how many times heads were selected (one per probe pass).
    """

    layers: list[int]
    heads: dict[int, torch.Tensor]
    vhd: torch.Tensor
    ta: torch.Tensor
    probe_logits: torch.Tensor | None = None
    selections: int = 0

    def counts(self) -> torch.Tensor:
        """`[B, len(layers)]` number of selected heads per sample and target layer (docs/methods/vhr.md)."""
        return torch.stack([self.heads[la].sum(-1) for la in self.layers], dim=-1)


@dataclass(eq=False, repr=False)
class VhdProbe(HeadOutputEdit):
    """The probe-pass head-output edit of one layer: VHD, selection and scaling (docs/methods/vhr.md).

    It runs on the `2B`-row probe batch (rows `:B` with image, `B:` without). It measures VHD
    and TA at the last position; in a target layer (`select=True`) it selects and returns the
    outputs with the selected heads times `alpha` (in both rows, or only the with-image row
    when `reinforce_without=False`); elsewhere it only measures.
    """

    alpha: float = 2.0
    select: bool = True
    reinforce_without: bool = True
    outliers: bool = True
    ddof: int = 0
    result: VhrSelection | None = None

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        res = self.result
        assert res is not None  # set by Vhr.select
        b = z.shape[0] // 2
        zw, zo = z[:b, -1].float(), z[b:, -1].float()  # [B, H, d]
        vhd = (zw - zo).norm(dim=-1)
        ta = zo.pow(2).sum(-1)
        res.vhd[:, self.layer] = vhd.cpu()
        res.ta[:, self.layer] = ta.cpu()
        if not self.select:
            return z
        chosen, _ = select_heads_vhd(vhd, ta, outliers=self.outliers, ddof=self.ddof)
        res.heads[self.layer] = chosen.cpu()
        other = chosen if self.reinforce_without else torch.zeros_like(chosen)
        rows = torch.cat([chosen, other])[:, None, :, None]  # [2B, 1, H, 1]
        return torch.where(rows, z * self.alpha, z)


@torch.no_grad()
def measure_vhd(
    model: HeadModel,
    enc: EncodedPrompts,
    spans: list[list[tuple[int, int]]],
    without_image: WithoutImage = "delete",
    extra: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VHD and TA of every head at the last prompt position, measured on the *unmodified* model
    from one batched probe prefill (`probe_inputs`: rows `:B` with the image, `B:` without; no
    head is reinforced). `extra` edits run in the same pass (e.g. recorders of the with-image
    rows' attention); they see all `2B` rows.

    Returns:
        `(vhd, ta)`, each `[B, L, H]` fp32.

    Raises:
        ValueError: an unknown `without_image`, a sample holding nothing but the span.
    """
    model.check_length(enc.length)
    inputs = probe_inputs(model, enc, spans, without_image)
    b, n_l, n_h = enc.batch, model.n_layers, model.n_heads
    nan = torch.full((b, n_l, n_h), float("nan"))
    res = VhrSelection(list(range(n_l)), {}, nan.clone(), nan.clone())
    probes = [VhdProbe(layer=la, select=False, result=res) for la in range(n_l)]
    with editing(model, [*probes, *(extra or [])]):
        model.run(**{k: v.to(model.device) for k, v in inputs.items()}, use_cache=False, logits_to_keep=1)
    return res.vhd, res.ta


def _check_alpha(alpha: object) -> float:
    alpha = check_number("alpha", alpha)
    if float(alpha) <= 0:
        raise HeadsteerValueError(f"alpha must be > 0 (1 = no-op, < 1 suppresses), got {short_repr(alpha)}")
    if float(alpha) > 1e4:
        raise HeadsteerValueError(f"alpha must be <= 1e4, got {short_repr(alpha)}")
    return float(alpha)


@dataclass(frozen=True)
class Vhr:
    """Vision-aware head reinforcement (VHR), for an image or a marked text context.

    Args:
        alpha: factor on the selected heads' outputs (default 2, the paper's). 1 is a bitwise
            no-op; 0 < alpha < 1 suppresses (allowed, with a warning); <= 0 raises.
        layers: target layers (default `default_vhr_layers`: {1} + the last round(14L/32)).
        target: what is removed in the second row: `"image"` (the image spans), `"text"`
            (the emphasized context passage) or `"auto"` (image spans where the batch has
            any, else the emphasized text; default).
        reinforce_without: also reinforce the without-image row in earlier layers (default
            True, docs/methods/vhr.md; False: only the with-image row).
        outliers: apply the outlier zeroing (default True).
        ddof: std correction for the outlier rule (0 = population, default).
        reuse_cache: keep the probe pass's KV cache of the with-image rows (text prompts) so
            that `SteeredModel.generate` does not prefill them again: VHR then costs one extra
            prefill row per prompt (docs/methods/vhr.md). Default True.
        without_image: how the without-image (without-context) row is built (docs/methods/vhr.md):
            `"delete"` (default) removes the image / passage tokens and renumbers positions
            contiguously; `"mask"` keeps every token and position and masks the image /
            passage out of attention (zero attention from every query).

    Raises:
        TypeError: `reinforce_without`, `outliers` or `reuse_cache` not a bool (at construction).
        ValueError: bad alpha / layers / target / without_image / ddof (at construction), no span to
            remove in any prompt, or an unknown layer (when applied).

    Source: He et al. 2025, §3 (Eq. 2-4), Algorithm 1.
    """

    alpha: float = 2.0
    layers: tuple[int, ...] | None = None
    target: Target = "auto"
    reinforce_without: bool = True
    outliers: bool = True
    ddof: int = 0
    reuse_cache: bool = True
    without_image: WithoutImage = "delete"
    last: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        if self.alpha < 1:
            warnings.warn(
                f"VHR alpha={self.alpha} < 1 suppresses the vision-aware heads (the paper's ablation: "
                "more hallucination)",
                stacklevel=3,
            )
        if self.target not in ("auto", "image", "text"):
            raise HeadsteerValueError(
                f"unknown target {short_repr(self.target)}: use 'auto', 'image' or 'text'"
            )
        _check_without(self.without_image)
        if isinstance(self.ddof, bool) or not isinstance(self.ddof, int) or self.ddof not in (0, 1):
            raise HeadsteerValueError(f"ddof must be 0 or 1, got {short_repr(self.ddof)}")
        for flag in ("reinforce_without", "outliers", "reuse_cache"):
            if not isinstance(getattr(self, flag), bool):
                raise HeadsteerTypeError(
                    f"{flag} must be True or False, got {short_repr(getattr(self, flag))}"
                )
        if self.layers is not None:
            check_layer_list("layers", self.layers)

    def spans(self, enc: EncodedPrompts) -> list[list[tuple[int, int]]]:
        """Per row, the spans removed in the without-image row (see `target`)."""
        return enc.select_spans(self.target)

    def target_layers(self, model: HeadModel) -> list[int]:
        """The target layers for `model`, validated (ValueError on an unknown layer)."""
        layers = default_vhr_layers(model.n_layers) if self.layers is None else [int(x) for x in self.layers]
        for la in layers:
            model.check_head(la, 0)
        return sorted(set(layers))

    @torch.no_grad()
    def select(self, model: HeadModel, enc: EncodedPrompts) -> VhrSelection:
        """Run the batched probe prefill on `enc` and select heads per sample (docs/methods/vhr.md).

        Returns:
            `VhrSelection` (heads per target layer, VHD and TA at every layer, probe logits).

        Raises:
            ValueError: no prompt has a span to remove, or an unknown layer.
        """
        spans = self.spans(enc)
        if not any(spans):
            raise HeadsteerValueError(
                "VHR needs an image or a marked context passage (**...** / emphasize=) to remove"
            )
        layers = self.target_layers(model)
        model.check_length(enc.length)
        inputs = probe_inputs(model, enc, spans, self.without_image)
        b, n_l, n_h = enc.batch, model.n_layers, model.n_heads
        nan = torch.full((b, n_l, n_h), float("nan"))
        res = VhrSelection(layers, {}, nan.clone(), nan.clone())
        probes = [
            VhdProbe(
                layer=la,
                select=la in layers,
                alpha=self.alpha,
                reinforce_without=self.reinforce_without,
                outliers=self.outliers,
                ddof=self.ddof,
                result=res,
            )
            for la in range(n_l)
        ]
        keep = self.reuse_cache and not enc.inputs and enc.length > 1  # text prompts only
        with editing(model, probes):
            out = model.run(
                **{k: v.to(model.device) for k, v in inputs.items()}, use_cache=keep, logits_to_keep=1
            )
        res.probe_logits = out.logits[:, -1].float().cpu()
        self.last.pop("cache", None)
        if keep and out.past_key_values is not None:
            cache = out.past_key_values
            cache.batch_select_indices(torch.arange(b, device=model.device))  # the with-image rows
            cache.crop(-1)  # generate re-runs the last prompt token (one row) to start decoding
            self.last["cache"] = (enc.input_ids, cache)
        for b_, row in enumerate(spans):  # a row without span: nothing to compare, nothing chosen
            if not row:
                for la in layers:
                    res.heads[la][b_] = False
        res.selections += 1
        return res

    def take_prefill_cache(self, enc: EncodedPrompts) -> object | None:
        """The probe pass's KV cache of `enc`'s rows up to the last prompt token (P - 1 keys),
        computed with the selected heads reinforced, or None; it is handed out once.
        `SteeredModel.generate` passes it to `generate` when VHR is the only intervention."""
        ids, cache = self.last.pop("cache", (None, None))
        return cache if ids is not None and torch.equal(ids, enc.input_ids) else None

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[HeadScale]:
        """Select heads for the batch `enc` (one probe prefill) and return one `HeadScale` per
        target layer with per-row head masks, scaling every position (prompt and decode).

        A prompt without a span to remove is left unsteered (`UnsteeredRowsWarning`).
        The selection is kept in `self.last["selection"]` for inspection.
        """
        if self.alpha == 1.0:
            self.target_layers(model)
            return []
        warn_rows_without_span(enc, "VHR", spans=self.spans(enc))
        sel = self.select(model, enc)
        self.last["selection"] = sel
        return [HeadScale(layer=la, row_heads=sel.heads[la], factor=self.alpha) for la in sel.layers]

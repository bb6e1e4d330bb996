"""T-VHD per decode step (He et al., ACL 2025, arXiv:2412.13949, §2 "T-VHD"; docs/methods/vhr.md).

`vhd_trace` decodes greedily from the with-image prompt and, at every generated position t,
measures the VHD of every head, `||A_{l,i}(y_t | y_<t, x_V, x_T) - A_{l,i}(y_t | y_<t, x_T)||_2`,
and T-VHD_t = sum over layers of the top-k VHD of the layer. The with- and without-image
branches run as the two rows of one batched forward per step (VHR's probe batch,
`steer.vhr.method.probe_inputs`), with a KV cache: the without-image row is fed the tokens the
with-image row generates, so both condition on the same history y_<t. Analysis only: the
model is not steered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd
import torch

from heads._util.validation import check_bool, check_int, is_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import Emphasis, Prompt
from heads.inputs.tokens import readable_tokens
from heads.model.adapter import HeadModel
from steer.steered_model import SteeredModel
from steer.vhr.method import Target, WithoutImage, _check_without, probe_inputs, t_vhd

__all__ = ["VhdTrace", "vhd_trace"]

MAX_NEW_TOKENS = 4096
"""Largest `max_new_tokens` `vhd_trace` accepts."""


@dataclass(eq=False, repr=False)
class _VhdRecorder(HeadOutputEdit):
    """Records VHD and TA of one layer at the last position of a 2-row probe batch; changes nothing."""

    vhd: list[torch.Tensor] = field(default_factory=list, init=False)
    ta: list[torch.Tensor] = field(default_factory=list, init=False)

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        zw, zo = z[0, -1].float(), z[1, -1].float()  # [H, d]
        self.vhd.append((zw - zo).norm(dim=-1).cpu())
        self.ta.append(zo.pow(2).sum(-1).cpu())
        return z


@dataclass
class VhdTrace:
    """Result of `vhd_trace`.

    Attributes:
        frame: one row per generated token: `step` (t, from 0), `token_id`, `token` (its text
            as readable text, `heads.inputs.tokens.readable_tokens`: `␣the`, `⏎`), `t_vhd`
            (T-VHD_t at the position that generated it).
        vhd: `[T, L, H]` VHD of every head at every step (fp32).
        ta: `[T, L, H]` squared norm of every head's output without the image.
        text: the generated continuation.
        k: heads per layer in T-VHD; reduce: "sum" or "mean" of the top-k.
    """

    frame: pd.DataFrame
    vhd: torch.Tensor
    ta: torch.Tensor
    text: str
    k: int
    reduce: str


def _eos_ids(model: HeadModel) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model.model, "generation_config", None), model.tokenizer):
        e = getattr(src, "eos_token_id", None)
        ids |= {int(x) for x in (e if isinstance(e, (list, tuple)) else [e]) if isinstance(x, int)}
    return ids


@torch.no_grad()
def vhd_trace(
    model: HeadModel,
    prompt: Prompt,
    *,
    images: object = None,
    emphasize: Emphasis = None,
    chat: bool | None = None,
    max_new_tokens: int = 32,
    k: int = 4,
    reduce: Literal["sum", "mean"] = "sum",
    target: Target = "auto",
    without_image: WithoutImage = "delete",
    use_cache: bool = True,
) -> VhdTrace:
    """VHD of every head and T-VHD at every generated token (docs/methods/vhr.md, analysis only).

    Args:
        model: a `HeadModel` (text, or vision-language with a processor).
        prompt: one prompt; the image (`images`, one image) or the emphasized context passage
            (`**...**` markup or `emphasize=`) is what the second row goes without.
        max_new_tokens: tokens to generate greedily (stops early at EOS; default 32).
        k: heads per layer in T-VHD (default 4); reduce: top-k "sum" (default) or "mean".
        target: `"image"`, `"text"` or `"auto"` (as `Vhr.target`).
        without_image: `"delete"` (default) or `"mask"` (as `Vhr.without_image`).
        use_cache: decode with a KV cache (default); False re-runs both full rows every step
            (the slow reference; same values).

    Returns:
        `VhdTrace` with one row per generated token. Step 0 is the last prompt position: its
        VHD equals the probe VHD of `Vhr(alpha=1).select`.

    Raises:
        ValueError: a bad `max_new_tokens`, `k`, `reduce`, `target` or `without_image`, or a
            prompt with nothing to remove (all checked before any forward pass).
    """
    if not is_int(max_new_tokens):
        raise HeadsteerValueError(
            f"max_new_tokens must be an int in 1..{MAX_NEW_TOKENS}, got {short_repr(max_new_tokens)}"
        )
    if not 1 <= int(max_new_tokens) <= MAX_NEW_TOKENS:
        raise HeadsteerValueError(
            f"max_new_tokens must be an int in 1..{MAX_NEW_TOKENS}, got {short_repr(max_new_tokens)}"
        )
    check_int("k", k, lo=1, hi=model.n_heads)
    check_bool("use_cache", use_cache)
    if chat is not None and not isinstance(chat, bool):
        raise HeadsteerTypeError(f"chat must be True, False or None, got {short_repr(chat)}")
    if reduce not in ("sum", "mean"):
        raise HeadsteerValueError(f"unknown reduce {short_repr(reduce)}: use 'sum' or 'mean'")
    if target not in ("auto", "image", "text"):
        raise HeadsteerValueError(f"unknown target {short_repr(target)}: use 'auto', 'image' or 'text'")
    _check_without(without_image)
    one_chat = (
        isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)
    )
    if not (isinstance(prompt, str) or one_chat):
        raise HeadsteerValueError(
            f"vhd_trace takes one prompt (a string or one chat message list), got {short_repr(prompt)}"
        )
    imgs = None if images is None else (images if isinstance(images, (list, tuple)) else [images])
    enc = SteeredModel(model).encode([prompt], images=imgs, emphasize=emphasize, chat=chat)
    spans = enc.select_spans(target)
    if not spans[0]:
        raise HeadsteerValueError(
            "vhd_trace needs an image or a marked context passage (**...** / emphasize=) to remove"
        )
    model.check_length(enc.length + int(max_new_tokens))
    dev = model.device
    inputs = {n: v.to(dev) for n, v in probe_inputs(model, enc, spans, without_image).items()}
    recs = [_VhdRecorder(layer=la) for la in range(model.n_layers)]
    eos = _eos_ids(model)
    tokens: list[int] = []
    with editing(model, recs):
        out = model.run(**inputs, use_cache=use_cache, logits_to_keep=1)
        cache = out.past_key_values if use_cache else None
        mask, pos = inputs["attention_mask"], inputs["position_ids"]
        for step in range(int(max_new_tokens)):
            nxt = int(out.logits[0, -1].argmax())
            tokens.append(nxt)
            if nxt in eos or step == int(max_new_tokens) - 1:
                break
            new = torch.tensor([[nxt], [nxt]], device=dev)
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=-1)
            pos = torch.cat([pos, pos[..., -1:] + 1], dim=-1)
            if use_cache:
                out = model.run(
                    input_ids=new,
                    attention_mask=mask,
                    position_ids=pos[..., -1:],
                    past_key_values=cache,
                    use_cache=True,
                )
            else:
                ids = torch.cat(
                    [inputs["input_ids"], torch.tensor([tokens], device=dev).expand(2, -1)], dim=-1
                )
                full = {**inputs, "input_ids": ids, "attention_mask": mask, "position_ids": pos}
                out = model.run(**full, use_cache=False, logits_to_keep=1)
    vhd = torch.stack([torch.stack(r.vhd) for r in recs], dim=1)  # [T, L, H]
    ta = torch.stack([torch.stack(r.ta) for r in recs], dim=1)
    tvhd = t_vhd(vhd, int(k), reduce=reduce)
    tok = model.tokenizer
    # readable text as in every other table (`␣the`, `⏎`), not the raw decode
    texts = readable_tokens(tok, tokens) if tok is not None else [str(t) for t in tokens]
    frame = pd.DataFrame(
        {"step": range(len(tokens)), "token_id": tokens, "token": texts, "t_vhd": tvhd.tolist()}
    )
    text = str(tok.decode(tokens, skip_special_tokens=True)) if tok is not None else ""
    return VhdTrace(frame, vhd, ta, text, int(k), reduce)

"""`headsteer report vision`: VHD heatmap, VAR image-centric head map and sink positions over the
image grid, for one prompt with an image (or with a marked context passage on a text model).

`vision_analysis` computes the numbers (a `VisionAnalysis`); `render_vision_report` draws
them; `vision_report` does both and writes the HTML.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import torch

from heads import HeadModel, HeadScores
from heads._util.files import check_output, write_text
from heads._util.validation import check_int
from heads.engine.context import editing
from heads.engine.forward import forward
from heads.inputs.tokens import readable_tokens
from steer import SteeredModel
from steer.carve import Carve, CarveMaps
from steer.var import Var, VarEdit
from steer.vhr.method import Vhr, t_vhd
from steer.vhr.trace import vhd_trace
from steer.visual_modulation import TokenSelection, VisualModulation
from viz.figures import head_heatmap
from viz.reports.base import Report

__all__ = ["VisionAnalysis", "render_vision_report", "vision_analysis", "vision_report"]


@dataclass
class VisionAnalysis:
    """Numbers of the vision report (sample 0 of the batch).

    Attributes:
        vhd: `HeadScores` of VHD per head (probe pass, earlier target layers reinforced).
        vhr_heads: `{layer: [heads]}` chosen by VHR.
        t_vhd: T-VHD (k = 4 or H) of the prompt.
        image_centric: `HeadScores` of the share of eligible query rows where each head was
            image-centric under VAR (NaN in layers VAR does not edit); None when VAR could
            not run (no sink dims, see `var_error`).
        sinks: `[L, n]` bool sink flags of the image (or context) tokens entering each layer.
        grid: `(rows, cols)` of the image tokens for the sink map (a square grid when n is a
            square, else one row).
        span_tokens: the image / context tokens (strings).
        params: the settings used.
        var_error: why VAR did not run, if it did not.
        trace: T-VHD per generated token (`steer.vhr.trace` frame: step, token_id, token,
            t_vhd; unsteered greedy decoding), or None when `trace_tokens` was 0.
        selection: the head-specific visual modulation's dual-stream token selection of the
            first image (or passage), `steer.visual_modulation.TokenSelection`.
        sensitivity: `HeadScores` of each head's visual sensitivity (VHD / max over the edited layers).
        carve: CARVE's maps of the image (`steer.carve.CarveMaps`), or None without an image.
    """

    vhd: HeadScores
    vhr_heads: dict[int, list[int]]
    t_vhd: float
    image_centric: HeadScores | None
    sinks: torch.Tensor | None
    grid: tuple[int, int]
    span_tokens: list[str]
    model: str
    params: dict = field(default_factory=dict)
    var_error: str | None = None
    seconds: float | None = None
    trace: pd.DataFrame | None = None
    selection: TokenSelection | None = None
    sensitivity: HeadScores | None = None
    carve: CarveMaps | None = None


@torch.no_grad()
def vision_analysis(
    model: HeadModel,
    prompt: str,
    image: object | None = None,
    *,
    vhr: Vhr | None = None,
    var: Var | None = None,
    trace_tokens: int = 16,
    modulation: VisualModulation | None = None,
    carve: Carve | None = None,
) -> VisionAnalysis:
    """Run VHR's probe pass and a VAR-edited forward on one prompt (with `image` on a VLM; a
    `**marked**` passage otherwise) and collect the report's numbers; with `trace_tokens` > 0
    also T-VHD at each of that many greedily generated tokens (`steer.vhr.trace`). Also the
    head-specific visual modulation's token selection and head sensitivity (`modulation`, default
    `VisualModulation()`), and with an image CARVE's contrast maps (`carve`, default `Carve()`).

    Raises:
        ValueError: no image and no marked passage, a negative `trace_tokens`; see
            `Vhr.select` and `Var.edits`.
    """
    check_int("trace_tokens", trace_tokens, lo=0)
    t0 = time.perf_counter()
    vhr = vhr or Vhr()
    var = var or Var()
    sm = SteeredModel(model)
    enc = sm.encode([prompt], images=None if image is None else [image])
    sel = vhr.select(model, enc)
    vhd = HeadScores(sel.vhd[0], "vhd", {"alpha": vhr.alpha}, model.name, model.n_kv_heads)
    heads = {la: torch.nonzero(sel.heads[la][0]).flatten().tolist() for la in sel.layers}
    spans = var.spans(enc)[0]
    cols = [t for t0_, t1 in spans for t in range(t0_, t1)]
    tok = model.tokenizer
    span_tokens = readable_tokens(tok, enc.input_ids[0, cols].tolist()) if cols else []
    n = len(cols)
    side = math.isqrt(n)
    grid = (side, side) if side * side == n and n else (1, max(n, 1))
    image_centric, sinks, err = None, None, None
    try:
        edits = var.edits(model, enc)
        with editing(model, edits):
            forward(model, enc)
        tracker = var.last["tracker"]
        ratio = torch.full((model.n_layers, model.n_heads), float("nan"))
        for e in edits:
            if isinstance(e, VarEdit):  # the others are the sink tracker's residual reads
                ratio[e.layer] = e.selected.float() / e.considered.float().clamp(min=1)
        image_centric = HeadScores(ratio, "var_image_centric", {"rho": var.rho, "p": var.p}, model.name)
        sinks = torch.zeros(model.n_layers, n, dtype=torch.bool)
        for la, flags in tracker.flags.items():
            sinks[la] = flags[0, cols]
    except ValueError as exc:
        err = str(exc)
    vm = modulation or VisualModulation()
    selection, vhd_probe = vm.probe(model, enc)
    sens = vm.sensitivity(vhd_probe, vm.target_layers(model))[0]
    sensitivity = HeadScores(sens, "visual_sensitivity", {"layers": vm.target_layers(model)}, model.name)
    carve_maps = None
    if image is not None:
        carve_maps = (carve or Carve()).maps(model, [prompt], [image])[0][0]
    params = {"prompt": prompt, "image": image is not None, "vhr_alpha": vhr.alpha, "var_rho": var.rho}
    params |= {"var_p": var.p, "layers_vhr": sel.layers}
    k = min(4, model.n_heads)
    trace = None
    if trace_tokens:
        tr = vhd_trace(
            model, prompt, images=image, max_new_tokens=trace_tokens, k=k, without_image=vhr.without_image
        )
        trace = tr.frame
    return VisionAnalysis(
        vhd,
        heads,
        float(t_vhd(sel.vhd[0], k=k)),
        image_centric,
        sinks,
        grid,
        span_tokens,
        model.name,
        params,
        err,
        time.perf_counter() - t0,
        trace,
        selection[0][0] if selection and selection[0] else None,
        sensitivity,
        carve_maps,
    )


def render_vision_report(result: VisionAnalysis) -> Report:
    """The vision report of a computed `VisionAnalysis` (nothing is recomputed)."""
    rep = Report("Vision-aware heads: VHD, image-centric heads and visual sinks", result.model, result.params)
    rep.text(
        "Method",
        "VHD (He et al., ACL 2025): distance of each head's output at the last prompt token with and "
        "without the image (or context passage), from one batched prefill; VHR scales the heads above "
        "each target layer's median. Image-centric heads (Kang et al., ICLR 2025): share of query rows "
        "after the image where the head puts >= 0.2 of its attention on the image and at least rho of "
        "that on non-sink image tokens. Sinks: tokens whose residual entering a layer has a massive "
        "value in the backbone's sink dimensions.",
    )
    sel = HeadScores(torch.zeros_like(result.vhd.scores), "vhr_selected", {}, result.model)
    for la, hs in result.vhr_heads.items():
        sel.scores[la, hs] = 1.0
    rep.figure("VHD per head", head_heatmap(result.vhd, title=f"VHD (T-VHD = {result.t_vhd:.3g})"))
    rows = [{"layer": la, "heads": str(hs), "count": len(hs)} for la, hs in result.vhr_heads.items()]
    rep.table("Heads reinforced by VHR", pd.DataFrame(rows))
    if result.trace is not None and len(result.trace):
        tr = result.trace
        rep.figure(
            "T-VHD per generated token",
            go.Figure(
                go.Scatter(
                    x=tr["step"].tolist(),
                    y=tr["t_vhd"].tolist(),
                    mode="lines+markers+text",
                    text=list(tr["token"]),  # readable text: `␣the`, `⏎`
                    textposition="top center",
                ),
                layout={"xaxis_title": "generated token t", "yaxis_title": "T-VHD_t", "height": 400},
            ),
        )
    _modulation_and_carve(rep, result)
    if result.image_centric is None:
        rep.text("VAR", f"not run: {result.var_error}")
        return rep
    rep.figure("Image-centric heads (VAR)", head_heatmap(result.image_centric, title="image-centric share"))
    s = result.sinks.float()
    rep.figure(
        "Sinks among the image tokens, per layer",
        go.Figure(
            go.Heatmap(z=s.tolist(), colorscale="Greys", x=list(range(s.shape[1]))),
            layout={"xaxis_title": "image token", "yaxis_title": "layer", "height": 400},
        ),
    )
    rows_, cols_ = result.grid
    counts = s.sum(0)[: rows_ * cols_].reshape(rows_, cols_)
    rep.figure(
        "Sink positions over the image grid (layers flagged per token)",
        go.Figure(
            go.Heatmap(z=counts.tolist(), colorscale="Reds"),
            layout={"yaxis": {"autorange": "reversed"}, "height": 400},
        ),
    )
    rep.seconds = result.seconds
    return rep


def _modulation_and_carve(rep: Report, result: VisionAnalysis) -> None:
    """The token-selection view and head sensitivity (visual modulation), and CARVE's maps."""
    sel = result.selection
    if sel is not None:
        kind = sel.local.long() + 2 * sel.spatial.long()  # 0 none, 1 local, 2 spatial, 3 both
        rows_, cols_ = sel.grid
        rep.figure(
            "Visual modulation: selected tokens over the grid",
            go.Figure(
                go.Heatmap(
                    z=kind.reshape(rows_, cols_).tolist(),
                    zmin=0,
                    zmax=3,
                    colorscale=[[0, "#eeeeee"], [0.33, "#1f77b4"], [0.66, "#ff7f0e"], [1, "#2ca02c"]],
                    colorbar={"tickvals": [0, 1, 2, 3], "ticktext": ["-", "local", "spatial", "both"]},
                ),
                layout={"yaxis": {"autorange": "reversed"}, "height": 360},
            ),
            note=f"{int(sel.selected.sum())} of {sel.selected.numel()} tokens selected (local stream: "
            "feature contrast to grid neighbours; spatial stream: the most attended token of each block).",
        )
    if result.sensitivity is not None:
        rep.figure(
            "Visual modulation: head sensitivity (VHD / max)",
            head_heatmap(result.sensitivity, title="sensitivity s (edited layers)"),
        )
    if result.carve is not None:
        from viz.reports.carve import carve_figures

        figs = carve_figures(result.carve)
        rep.figure("CARVE: entropy and convergence of the image attention by depth", figs["depth"])
        rep.figure("CARVE: task / general attention, contrast and kept pixels", figs["maps"])
        rep.figure("CARVE: input and refined image", figs["images"])


def vision_report(
    model: HeadModel,
    out: str | Path,
    prompt: str,
    image: object | None = None,
    *,
    vhr: Vhr | None = None,
    var: Var | None = None,
    overwrite: bool = False,
    trace_tokens: int = 16,
) -> tuple[Path, VisionAnalysis]:
    """Compute (`vision_analysis`) and write the vision report to `out` (HTML).

    Raises:
        ValueError: an existing `out` without `overwrite`, a symlink; see `vision_analysis`.
    """
    check_output(out, overwrite)
    result = vision_analysis(model, prompt, image, vhr=vhr, var=var, trace_tokens=trace_tokens)
    path = write_text(out, render_vision_report(result).to_html(), overwrite)
    return path, result

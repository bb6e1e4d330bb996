"""CARVE's contrast maps as figures, and the paper's observation checks as a report
(docs/methods/carve.md).

* `carve_figures(maps)`: per layer, the entropy and the convergence of the image attention under the
  task prompt and under the general instruction; the task map, the general map, the contrast and the
  kept pixels over the image; the image and its refinement.
* `carve_observations(model, prompt)`: synthetic images of controlled complexity (a grey canvas with
  k coloured squares, k in `complexities`, several seeds each); per image the per-layer entropy and
  convergence of the task attention. It reports the Spearman correlation of visual complexity
  with the mean entropy (the paper's finding 1: positive) and, per layer, the mean entropy (finding
  2: falling from shallow to deep layers, i.e. a negative Spearman correlation with depth).
* `carve_report(model, out, prompt, image)`: both, written as one HTML report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from heads import HeadModel
from heads._util.files import check_output, write_text
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_int, check_seed, short_repr
from heads.errors import HeadsteerValueError
from steer.carve import Carve, CarveMaps
from viz.reports.base import Report

__all__ = [
    "CarveObservations",
    "carve_figures",
    "carve_observations",
    "carve_report",
    "complexity_image",
]

_PALETTE = [(220, 30, 30), (30, 170, 40), (30, 60, 220), (235, 210, 30), (250, 250, 250), (10, 10, 10)]


def complexity_image(k: int, size: int = 16, *, seed: int = 0) -> Any:
    """A `size x size` RGB PIL image: a grey canvas with `k` squares (side size // 4) of seeded
    colours from a fixed palette at seeded positions; k = 0 is the plain canvas."""
    from PIL import Image

    check_int("k", k, lo=0, hi=1024)
    check_int("size", size, lo=4, hi=4096)
    rng = np.random.default_rng(seed)
    arr = np.full((size, size, 3), 128, dtype=np.uint8)
    side = max(1, size // 4)
    for _ in range(k):
        y, x = rng.integers(0, size - side + 1, size=2)
        arr[y : y + side, x : x + side] = _PALETTE[int(rng.integers(len(_PALETTE)))]
    return Image.fromarray(arr)


def _grid_fig(values: list[torch.Tensor], titles: list[str], grid: tuple[int, int]) -> go.Figure:
    fig = make_subplots(rows=1, cols=len(values), subplot_titles=titles, horizontal_spacing=0.04)
    for i, v in enumerate(values, start=1):
        z = v.float().reshape(grid).tolist()
        fig.add_trace(go.Heatmap(z=z, colorscale="Viridis", showscale=False), row=1, col=i)
        fig.update_yaxes(autorange="reversed", showticklabels=False, row=1, col=i)
        fig.update_xaxes(showticklabels=False, row=1, col=i)
    fig.update_layout(height=300)
    return fig


def carve_figures(maps: CarveMaps) -> dict[str, go.Figure]:
    """Figures of one image's CARVE maps (module docstring): `"depth"`, `"maps"`, `"images"`."""
    layers = list(range(maps.task.maps.shape[0]))
    depth = go.Figure()
    for name, att in (("task", maps.task), ("general", maps.general)):
        depth.add_scatter(x=layers, y=att.entropy.tolist(), name=f"entropy ({name})", mode="lines+markers")
        depth.add_scatter(
            x=layers,
            y=att.convergence.tolist(),
            name=f"convergence ({name})",
            mode="lines+markers",
            line={"dash": "dot"},
        )
    depth.update_layout(xaxis_title="layer", yaxis_title="normalised entropy / top-10% share", height=360)
    rows, cols = maps.task.grid
    h, w = maps.mask.shape
    kept = torch.nn.functional.adaptive_avg_pool2d(maps.mask.float()[None, None], (rows, cols))[0, 0]
    grid_fig = _grid_fig(
        [maps.task.mean_map(maps.layers), maps.general.mean_map(maps.layers), maps.contrast, kept.flatten()],
        ["task attention", "general attention", "contrast", "kept share"],
        (rows, cols),
    )
    images = make_subplots(rows=1, cols=2, subplot_titles=["input", "refined"])
    images.add_trace(go.Image(z=np.asarray(maps.image)), row=1, col=1)
    images.add_trace(go.Image(z=np.asarray(maps.refined)), row=1, col=2)
    images.update_layout(height=300)
    return {"depth": depth, "maps": grid_fig, "images": images}


@dataclass
class CarveObservations:
    """Result of `carve_observations`.

    Attributes:
        frame: one row per (image, layer): `complexity`, `seed`, `layer`, `entropy`, `convergence`,
            `mass` (the task attention's share on the image).
        complexity_rho: Spearman correlation of complexity with the per-image mean entropy (and its
            p-value, `complexity_p`).
        depth_rho: Spearman correlation of the layer index with the mean entropy per layer (`depth_p`).
        params: the settings; model: the model's name.
    """

    frame: pd.DataFrame
    complexity_rho: float
    complexity_p: float
    depth_rho: float
    depth_p: float
    params: dict = field(default_factory=dict)
    model: str = ""

    def figure(self) -> go.Figure:
        """Mean entropy per layer, one line per complexity."""
        fig = go.Figure()
        for k, grp in self.frame.groupby("complexity"):
            m = grp.groupby("layer")["entropy"].mean()
            fig.add_scatter(x=m.index.tolist(), y=m.tolist(), name=f"{k} squares", mode="lines+markers")
        fig.update_layout(
            xaxis_title="layer", yaxis_title="normalised entropy of the image attention", height=380
        )
        return fig


@torch.no_grad()
def carve_observations(
    model: HeadModel,
    prompt: str = "What colour is the square?",
    *,
    complexities: Sequence[int] = (0, 1, 2, 4, 8),
    seeds: int = 3,
    size: int = 16,
    progress: ProgressArg = None,
) -> CarveObservations:
    """The paper's observation checks on synthetic images (module docstring).

    Raises:
        ValueError: a model without a processor, an empty prompt, bad complexities / seeds / size.
    """
    from scipy.stats import spearmanr

    from heads.scorers.image_attention import convergence as conv_of
    from heads.scorers.image_attention import image_attention
    from steer import SteeredModel

    if getattr(model, "processor", None) is None:
        raise HeadsteerValueError(
            f"carve_observations needs a vision-language model, got {short_repr(model.name)}"
        )
    if not isinstance(prompt, str) or not prompt.strip():
        raise HeadsteerValueError("prompt is empty")
    ks = [check_int("complexity", k, lo=0, hi=1024) for k in complexities]
    if len(set(ks)) < 2:
        raise HeadsteerValueError(
            f"complexities needs at least two different values, got {short_repr(complexities)}"
        )
    seeds = check_int("seeds", seeds, lo=1, hi=256)
    check_int("size", size, lo=4, hi=4096)
    sm = SteeredModel(model)
    rows = []
    jobs = [(k, s) for k in ks for s in range(seeds)]
    with progress_callback(progress, "carve observations", "images") as report:
        for i, (k, s) in enumerate(jobs):
            img = complexity_image(k, size, seed=check_seed("seed", 1000 * k + s))
            att = image_attention(model, sm.encode([prompt], images=[img]), target="image")[0][0]
            ent, con = att.entropy, conv_of(att.maps)
            for la in range(att.maps.shape[0]):
                rows.append(
                    {
                        "complexity": k,
                        "seed": s,
                        "layer": la,
                        "entropy": float(ent[la]),
                        "convergence": float(con[la]),
                        "mass": float(att.mass[la]),
                    }
                )
            if report is not None:
                report(i + 1, len(jobs))
    frame = pd.DataFrame(rows)
    per_image = frame.groupby(["complexity", "seed"])["entropy"].mean().reset_index()
    c = spearmanr(per_image["complexity"], per_image["entropy"])
    per_layer = frame.groupby("layer")["entropy"].mean()
    d = spearmanr(per_layer.index, per_layer.to_numpy()) if len(per_layer) > 1 else (float("nan"),) * 2
    params = {"prompt": prompt, "complexities": ks, "seeds": seeds, "size": size}
    return CarveObservations(frame, float(c[0]), float(c[1]), float(d[0]), float(d[1]), params, model.name)


def carve_report(
    model: HeadModel,
    out: str | Path,
    prompt: str,
    image: Any,
    *,
    carve: Carve | None = None,
    observations: bool = True,
    complexities: Sequence[int] = (0, 1, 2, 4, 8),
    seeds: int = 3,
    overwrite: bool = False,
) -> tuple[Path, CarveMaps, CarveObservations | None]:
    """Write the CARVE report (the maps of `image` under `prompt`; with `observations`, the checks on
    synthetic images of `complexities` squares, `seeds` images each) to `out` (HTML).

    Raises:
        ValueError: an existing `out` without `overwrite`, a symlink; see `Carve.maps`.
    """
    check_output(out, overwrite)
    t0 = time.perf_counter()
    carve = carve or Carve()
    maps = carve.maps(model, [prompt], [image])[0][0]
    obs = carve_observations(model, complexities=complexities, seeds=seeds) if observations else None
    params = {
        "prompt": prompt,
        "general": carve.general,
        "keep": carve.keep,
        "eps": carve.eps,
        "layers": maps.layers,
    }
    rep = Report("CARVE: contrastive attention refinement", model.name, params)
    rep.text(
        "Method",
        "The attention of the last prompt token on the image, per layer (head mean), under the task "
        "prompt and under a general instruction; their per-layer ratio task / (general + eps), averaged "
        "over the chosen layers, is the contrast. Its top pixels are kept and the rest of the image set "
        "to its mean colour; the question is answered again on the refined image (Ge et al. 2025).",
    )
    figs = carve_figures(maps)
    rep.figure("Entropy and convergence by depth", figs["depth"])
    rep.figure("Maps over the image grid (contrasted layers)", figs["maps"])
    rep.figure("Input and refined image", figs["images"])
    if obs is not None:
        rep.figure(
            "Observation checks: entropy by depth, per visual complexity",
            obs.figure(),
            note=(
                f"Spearman rho (complexity vs mean entropy) = {obs.complexity_rho:.3f} "
                f"(p = {obs.complexity_p:.3g}); rho (depth vs mean entropy) = {obs.depth_rho:.3f} "
                f"(p = {obs.depth_p:.3g})."
            ),
        )
    rep.seconds = time.perf_counter() - t0
    path = write_text(out, rep.to_html(), overwrite)
    return path, maps, obs

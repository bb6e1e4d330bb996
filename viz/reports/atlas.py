"""`headsteer report atlas`: every head's role and scores on one page (Dodrio-style overview).

The numbers come from `heads.scorers.roles.head_atlas` (a `HeadAtlas`); `atlas_report` also
gathers what needs `probes` / `steer` (sink statistics on the shipped corpus, MAPS relations,
PASTA's shipped profile as a 0/1 column) and this module draws them (`render_atlas_report`):
a role map of all heads, roles per layer, a filterable table, and one card per head with its
pattern thumbnail, scores and (with a lens) its top lens tokens.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import plotly.graph_objects as go
import torch

from heads import HeadModel, SweepOptions
from heads._util.files import check_output
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_bool, check_path
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.scores import HeadScores
from heads.scorers.maps.request import MapsRequest
from heads.scorers.roles import AttentionLens, HeadAtlas
from heads.scorers.roles.request import AtlasRequest, DetectRolesRequest
from heads.scorers.sink_requests import SinkStatsRequest
from viz.reports.base import Report

__all__ = ["atlas_report", "atlas_steps", "render_atlas_report"]

_COLORS = {
    "induction": "#d62728",
    "previous_token": "#1f77b4",
    "duplicate_token": "#9467bd",
    "successor": "#2ca02c",
    "retrieval": "#ff7f0e",
    "self": "#8c564b",
    "sink": "#7f7f7f",
    "nan": "#fdd0a2",
    "none": "#f0f0f0",
}
_OTHER = ("#17becf", "#bcbd22", "#e377c2", "#aec7e8", "#98df8a", "#c5b0d5")
"""Colours of roles from user thresholds (score columns that are not a shipped role)."""


def _role_colors(roles: list[str]) -> dict[str, str]:
    """A colour per role in `roles`: the shipped ones, then the others in turn."""
    other = [r for r in roles if r not in _COLORS]
    return {**_COLORS, **{r: _OTHER[i % len(_OTHER)] for i, r in enumerate(other)}}


class _AtlasReport(Report):
    def block(self, heading: str, body: str, note: str | None = None) -> _AtlasReport:
        """A section of ready HTML (`body` is trusted: built here with escaped values)."""
        n = f"<p class='note'>{html.escape(note)}</p>" if note else ""
        self._parts.append(f"<h2>{html.escape(heading)}</h2>{n}{body}")
        return self


def _role_map(atlas: HeadAtlas) -> go.Figure:
    f = atlas.frame
    present = set(f["role"])
    colors = _role_colors(sorted(present))
    roles = [r for r in _COLORS if r in present] + sorted(present - set(_COLORS))
    code = {r: i for i, r in enumerate(roles)}
    n_layers, n_heads = int(f["layer"].max()) + 1, int(f["head"].max()) + 1
    z = [[0] * n_heads for _ in range(n_layers)]
    text = [[""] * n_heads for _ in range(n_layers)]
    for r in f.itertuples():
        z[r.layer][r.head] = code[r.role]
        text[r.layer][r.head] = r.role
    n = max(len(roles), 1)
    scale = []
    for i, r in enumerate(roles):
        scale += [[i / n, colors[r]], [(i + 1) / n, colors[r]]]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            text=text,
            zmin=-0.5,
            zmax=n - 0.5,
            colorscale=scale or [[0, "#f0f0f0"], [1, "#f0f0f0"]],
            colorbar={"tickvals": list(range(n)), "ticktext": roles, "title": "role"},
            hovertemplate="layer %{y}<br>head %{x}<br>%{text}<extra></extra>",
        )
    )
    fig.update_layout(xaxis_title="head", yaxis_title="layer", height=max(320, 18 * n_layers + 120))
    return fig


def _roles_by_layer(atlas: HeadAtlas) -> go.Figure:
    counts = atlas.roles_by_layer()
    colors = _role_colors(sorted(counts.columns))
    fig = go.Figure()
    for role in counts.columns:
        if role == "none":
            continue
        fig.add_bar(x=list(counts.index), y=counts[role].tolist(), name=role, marker_color=colors[role])
    fig.update_layout(barmode="stack", xaxis_title="layer", yaxis_title="heads", height=320)
    return fig


def _png(thumb: torch.Tensor) -> str:
    from PIL import Image

    t = thumb.float()
    a = (255 * (1 - t / t.max().clamp(min=1e-6))).clamp(0, 255).to(torch.uint8).numpy()
    img = Image.fromarray(a, mode="L").resize((72, 72), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _table(atlas: HeadAtlas) -> str:
    f = atlas.frame
    cols = list(f.columns)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)

    def cell(v: object) -> str:
        if isinstance(v, float):
            return "" if v != v else f"{v:.3f}"
        return html.escape(str(v))

    body = "".join(
        "<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in f.itertuples(index=False)
    )
    return (
        "<p><input id='atlas-filter' placeholder='filter rows (e.g. induction, or a layer number)' "
        "style='width:24em' oninput=\"var q=this.value.toLowerCase();document.querySelectorAll("
        "'#atlas-table tbody tr').forEach(function(r){r.style.display=r.textContent.toLowerCase()"
        ".indexOf(q)>=0?'':'none'})\"></p>"
        f"<div style='max-height:480px;overflow:auto'><table id='atlas-table'><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    )


def _cards(atlas: HeadAtlas) -> str:
    f = atlas.frame
    scores = atlas.score_columns
    colors = _role_colors(sorted(set(f["role"])))
    out = []
    for r in f.to_dict("records"):
        la, h = int(r["layer"]), int(r["head"])
        img = ""
        if atlas.thumbnails is not None:
            img = f"<img alt='pattern' src='data:image/png;base64,{_png(atlas.thumbnails[la, h])}'>"
        vals = " · ".join(
            f"{html.escape(c)} {r[c]:.2f}" for c in scores if isinstance(r[c], float) and r[c] == r[c]
        )
        rel = f"<br>best relation: {html.escape(str(r['best_relation']))}" if "best_relation" in r else ""
        toks = atlas.lens_tokens.get((la, h))
        lens = f"<br>lens tokens: {html.escape(' '.join(toks[:24]))}" if toks else ""
        color = colors.get(str(r["role"]), "#ddd")
        out.append(
            f"<div class='card' data-role='{html.escape(str(r['role']))}' "
            f"style='border-left:6px solid {color};"
            "padding:4px 8px;margin:4px;display:inline-block;width:330px;vertical-align:top;font-size:.8em'>"
            f"<b>L{la}.H{h}</b> (KV {int(r['kv_head'])}) — {html.escape(str(r['role']))}<br>"
            f"<div style='display:flex;gap:6px'>{img}<div>{vals}{rel}{lens}</div></div></div>"
        )
    return "<div>" + "".join(out) + "</div>"


def render_atlas_report(atlas: HeadAtlas, params: dict | None = None) -> Report:
    """The atlas page of a computed `HeadAtlas` (nothing is recomputed).

    Args:
        atlas: the atlas (`head_atlas` or `HeadAtlas.load`).
        params: parameters shown in the page's header (a dict; default none).

    Raises:
        HeadsteerTypeError: `atlas` not a `HeadAtlas`, `params` not a dict.
    """
    if not isinstance(atlas, HeadAtlas):
        raise HeadsteerTypeError(f"atlas must be a HeadAtlas, got {type(atlas).__name__}")
    if params is not None and not isinstance(params, dict):
        raise HeadsteerTypeError(f"params must be a dict or None, got {type(params).__name__}")
    rep = _AtlasReport(
        f"Head atlas: the role of every head ({len(atlas.frame)} heads)", atlas.model, dict(params or {})
    )
    thr = ", ".join(f"{k} >= {v:g}" for k, v in atlas.thresholds.items())
    rep.text(
        "Method",
        "Each head gets the first role, in this order, whose detector score reaches its threshold "
        f"({thr}), else 'none'. Detectors: attention on [BOS] + R + R random-token rows (previous-token, "
        "duplicate-token, induction, self, entropy), the OV circuit (copying; successor on ordinal "
        "sequences), and the needle copy-paste rate on needle-in-a-haystack prompts (retrieval).",
    )
    rep.figure("Role map", _role_map(atlas), note="Every head coloured by its role; hover for the name.")
    rep.figure("Roles per layer", _roles_by_layer(atlas), note="How many heads of each role every layer has.")
    stable = {n: s["stability"] for n, s in atlas.sources.items() if isinstance(s.get("stability"), dict)}
    if stable:
        lines = [
            f"{n}: top-{s['k']} Jaccard {s['jaccard_mean']:.2f} "
            f"[{s['jaccard_low']:.2f}, {s['jaccard_high']:.2f}] over {s['n_resamples']} resamples of "
            f"{s['n_samples']} sequences; stable top-{s['k']}: " + (", ".join(s["stable"]) or "none")
            for n, s in stable.items()
        ]
        rep.text(
            "Stability of the role rankings",
            " | ".join(lines) + ". A head is stable when it is in the top k of at least 95% of the "
            "bootstrap resamples; the <role>_p_top_k columns give that share for every head.",
        )
    rep.block("All scores", _table(atlas), note="One row per head; type in the box to filter rows.")
    rep.block(
        "Head cards",
        _cards(atlas),
        note="Per head: its pattern on a [BOS] + R + R row (darker = more attention; the induction stripe "
        "sits one step right of the diagonal of the second copy), its scores, best MAPS relation and "
        "lens tokens.",
    )
    return rep


def atlas_steps() -> int:
    """Progress steps of `atlas_report`."""
    return 5


def atlas_report(
    model: HeadModel,
    out: str | Path,
    *,
    lens: str | Path | AttentionLens | None = None,
    maps: bool = True,
    lens_text: str = "On Monday, Anna found a small lamp at the market. On Monday, Anna found a small lamp.",
    overwrite: bool = False,
    progress: ProgressArg = True,
    csv: str | Path | None = None,
    stability: int = 0,
    atlas_json: str | Path | None = None,
    request: DetectRolesRequest | None = None,
) -> tuple[HeadAtlas, dict]:
    """Compute the atlas of `model` and write the page to `out` (the table to `csv` and the atlas
    itself to `atlas_json` if given).

    Gathers the detectors, sink statistics on 16 shipped corpus texts, MAPS relations (with `maps`:
    the shipped relations with enough single-token pairs), PASTA's shipped profile for the embedded
    model (a 0/1 `pasta_profile` column) and, with `lens` (an `AttentionLens` file of this model),
    the lens KL ratio and top lens tokens of `lens_text`.

    Args:
        model: the model (a `HeadModel`).
        out: the HTML file to write.
        lens: an Attention Lens of this model: a file or a loaded `AttentionLens` (default None).
        maps: also score the MAPS relations (default True).
        lens_text: a non-empty text whose positions the lens cards show.
        overwrite: replace existing `out` / `csv` files (default False).
        progress: True (a bar), False / None, or a `(done, total)` callable in steps.
        csv: also write the table as CSV there (default None).
        stability: bootstrap resamples of the detectors' sequences (default 0: none): the
            pattern detectors' stable top-k heads on the page and `<role>_p_top_k` columns.
        atlas_json: also write the atlas as JSON there (`HeadAtlas.save`: the file
            `headsteer explore --atlas` and `HeadAtlas.load` read; default None).
        request: the detectors' request (default: `DetectRolesRequest(stability=stability)`;
            the CLI's, checked before the model loaded); `stability` may then not be given too.

    The analyses run as requests through `heads.run`: the detectors, `SinkStatsRequest(chat=False)`
    on the corpus texts, `MapsRequest()` on the relations, and `AtlasRequest(lens_text=...)` on
    the gathered scores.

    Returns:
        `(atlas, summary)`; summary: heads per role and the top heads of each detector.

    Raises:
        HeadsteerValueError: `out`, `csv` or `atlas_json` exists without `overwrite` (or is a folder
            or a symlink), two of them the same file; a bad lens file or one for another model; an
            empty `lens_text`.
        HeadsteerTypeError: an argument of a wrong type. All checked before any forward.
        FileNotFoundError: no `lens` file.
    """
    from heads import run
    from probes.datasets.corpus import load_corpus
    from probes.datasets.relations import load_relations

    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
    out = check_path("out", out)
    if lens is not None and not isinstance(lens, AttentionLens):
        lens = check_path("lens", lens)
    if csv is not None:
        csv = check_path("csv", csv)
    if atlas_json is not None:
        atlas_json = check_path("atlas_json", atlas_json)
    check_bool("maps", maps)
    check_bool("overwrite", overwrite)
    if request is None:
        request = DetectRolesRequest(stability=stability)
    elif stability != 0:
        raise HeadsteerValueError("give the request or stability=, not both")
    atlas_request = AtlasRequest(lens_text=lens_text)  # lens_text: a non-empty string
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise HeadsteerTypeError(
            f"progress must be True, False, None or a callable (done, total), got {type(progress).__name__}"
        )
    check_output(out, overwrite)
    seen = {Path(out).expanduser().resolve(): "out"}
    for name, extra_path in (("csv", csv), ("atlas_json", atlas_json)):
        if extra_path is None:
            continue
        where = Path(extra_path).expanduser().resolve()
        if where in seen:
            raise HeadsteerValueError(f"{name} and {seen[where]} are the same file: {str(extra_path)!r}")
        seen[where] = name
        check_output(extra_path, overwrite)
    if isinstance(lens, AttentionLens):
        lens.check_model(model)
        trained: AttentionLens | None = lens
    else:
        trained = AttentionLens.load(lens, model) if lens is not None else None
    if trained is not None:
        trained.kl_scores("ratio")  # an untrained lens is refused before the detectors run
    extra: dict[str, HeadScores] = {}
    with progress_callback(progress, "head atlas", "steps") as report:
        tick = (lambda i: report(i, atlas_steps())) if report is not None else (lambda i: None)
        tick(0)
        det = run(model, request)
        tick(1)
        sinks = None
        if model.tokenizer is not None:
            sinks = run(model, SinkStatsRequest(chat=False), load_corpus(16))
        tick(2)
        relations = None
        if maps and model.tokenizer is not None:
            try:
                rels = load_relations(model.tokenizer, d_vocab=model.d_vocab)
                relations = run(model, MapsRequest(), rels.relations, options=SweepOptions(progress=False))
            except ValueError:
                relations = None
        tick(3)
        profile = _pasta_profile(model)
        if profile is not None:
            extra["pasta_profile"] = profile
        gathered = {"detectors": det, "scores": extra, "sinks": sinks, "maps": relations, "lens": trained}
        if trained is None:
            atlas_request = atlas_request.replace(lens_text=None)  # the text is for a lens only
        atlas = run(model, atlas_request, gathered)
        tick(4)
        shown_lens = None if lens is None else repr(lens) if isinstance(lens, AttentionLens) else str(lens)
        render_atlas_report(atlas, {"lens": shown_lens}).save(out, overwrite=overwrite)
        if csv is not None:
            from heads._util.files import write_text

            write_text(csv, atlas.frame.to_csv(index=False), overwrite=overwrite)
        if atlas_json is not None:
            atlas.save(atlas_json, overwrite=overwrite)
        tick(5)
    summary = {
        "roles": {k: int(v) for k, v in atlas.frame["role"].value_counts().items()},
        "top": {
            n: [[la, h, round(float(s.scores[la, h]), 3)] for la, h in s.ranked(5)]
            for n, s in det.as_dict().items()
        },
    }
    return atlas, summary


def _pasta_profile(model: HeadModel) -> HeadScores | None:
    """PASTA's shipped head profile for this model as 0/1 scores, or None when none ships."""
    from heads.results.scores import HeadSet
    from steer.profiles import shipped_profile

    try:
        heads = HeadSet.parse(shipped_profile("pasta", model.name), model.n_layers, model.n_heads)
    except ValueError:  # no profile for this model
        return None
    s = torch.zeros(model.n_layers, model.n_heads)
    for la, h in heads:
        s[la, h] = 1.0
    return HeadScores(s, "pasta_profile", model=model.name, n_kv_heads=model.n_kv_heads)

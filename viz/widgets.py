"""The explorer's views as Jupyter widgets: a head-score grid, one head's pattern, a steering panel.

    from viz.widgets import scores_widget, pattern_widget, steering_panel
    scores_widget(span_attention(model, prompt))          # click a cell: .selected = (layer, head)
    pattern_widget(model, prompt, layer=3, head=1)
    panel = steering_panel(model, prompt, heads={3: [1]}); panel.run()   # or the panel's button

With `anywidget` installed (the `dev` extra pins it) each function returns a live widget
(`anywidget.AnyWidget`: the JavaScript is inline, nothing is fetched); without it, or where no
widget front end runs (a notebook executed headless, nbconvert, GitHub's viewer), the same view is
there as static HTML: every widget's output also carries a `text/html` rendering, and without
anywidget the functions return a `StaticView` holding only that HTML. All strings (tokens,
prompts, generations) are HTML-escaped in the static views and set with `textContent` live.
"""

import html
import json
from typing import Any

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.figures import DIVERGING, sign_note

__all__ = ["StaticView", "pattern_widget", "scores_widget", "steering_panel", "widgets_available"]


def widgets_available() -> bool:
    """True when `anywidget` can be imported (live widgets); False means static HTML views."""
    try:
        import anywidget  # noqa: F401
    except ImportError:
        return False
    return True


class StaticView:
    """A view as static HTML (what a notebook without widgets shows); `.html` is the markup."""

    def __init__(self, markup: str):
        self.html = markup

    def _repr_html_(self) -> str:
        return self.html


SIGNED_KEY = "blue < 0, white = 0, red > 0"
"""The colour key a grid with negative values shows (the figures' `DIVERGING` convention)."""


def _diverging(v: float, m: float) -> str:
    """`DIVERGING`'s colour of `v` on the range [-m, m] (white at exactly 0), as `#rrggbb`."""
    t = min(1.0, max(0.0, (v / m + 1) / 2)) if m > 0 else 0.5
    for (a, ca), (b, cb) in zip(DIVERGING, DIVERGING[1:], strict=False):
        a, b = float(a), float(b)
        if t <= b:
            f = 0.0 if b <= a else (t - a) / (b - a)
            x, y = str(ca), str(cb)
            rgb = (
                int(0.5 + int(x[i : i + 2], 16) + f * (int(y[i : i + 2], 16) - int(x[i : i + 2], 16)))
                for i in (1, 3, 5)
            )
            return "#" + "".join(f"{c:02x}" for c in rgb)
    return str(DIVERGING[-1][1])


def _colour(v: float | None, lo: float, hi: float) -> str:
    """A cell's colour: signed grids (`lo < 0`) on `DIVERGING`, centred on 0; others a light-to-blue
    ramp from `lo` to `hi`."""
    if v is None:
        return "#eee"
    if lo < 0:
        return _diverging(v, max(abs(lo), abs(hi)))
    t = 0.0 if hi <= lo else (v - lo) / (hi - lo)
    r, g, b = int(247 - 200 * t), int(251 - 150 * t), int(255 - 100 * t)
    return f"rgb({r},{g},{b})"


def _grid_html(
    title: str,
    rows: list[list[float | None]],
    row_labels: list[str],
    col_labels: list[str],
    note: str | None = None,
) -> str:
    vals = [v for row in rows for v in row if v is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in col_labels)
    body = []
    for label, row in zip(row_labels, rows, strict=True):
        cells = "".join(
            f'<td title="{html.escape(label)} / {html.escape(c)}: {"n/a" if v is None else f"{v:.4f}"}" '
            f'style="background:{_colour(v, lo, hi)};min-width:14px;height:14px"></td>'
            for c, v in zip(col_labels, row, strict=True)
        )
        body.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
    key = f"; {html.escape(SIGNED_KEY)}" if lo < 0 else ""
    said = f"<br><small>{html.escape(note)}</small>" if note else ""
    return (
        f'<div class="headsteer-view"><b>{html.escape(title)}</b> '
        f"<small>(min {lo:.4f}, max {hi:.4f}{key})</small>{said}"
        f'<table style="border-collapse:collapse;font-size:9px"><tr><th></th>{head}</tr>'
        f"{''.join(body)}</table></div>"
    )


def _clean(rows: list[list[float]]) -> list[list[float | None]]:
    import math

    return [[round(v, 5) if math.isfinite(v) else None for v in row] for row in rows]


_GRID_ESM = """
const DIVERGING = __DIVERGING__;  // viz.figures.DIVERGING: blue < 0, white = 0, red > 0
function diverging(v, m) {
  const t = m > 0 ? Math.min(1, Math.max(0, (v / m + 1) / 2)) : 0.5;
  for (let i = 1; i < DIVERGING.length; i++) {
    const [a, ca] = DIVERGING[i - 1], [b, cb] = DIVERGING[i];
    if (t <= b) {
      const f = b <= a ? 0 : (t - a) / (b - a);
      return "#" + [1, 3, 5].map((k) => {
        const x = parseInt(ca.slice(k, k + 2), 16), y = parseInt(cb.slice(k, k + 2), 16);
        return Math.round(x + f * (y - x)).toString(16).padStart(2, "0");
      }).join("");
    }
  }
  return DIVERGING[DIVERGING.length - 1][1];
}
function colour(v, lo, hi) {
  if (v === null) return "#eee";
  if (lo < 0) return diverging(v, Math.max(Math.abs(lo), Math.abs(hi)));  // signed: centred on 0
  const t = hi <= lo ? 0 : (v - lo) / (hi - lo);
  return `rgb(${Math.round(247 - 200 * t)},${Math.round(251 - 150 * t)},${Math.round(255 - 100 * t)})`;
}
function render({ model, el }) {
  const draw = () => {
    const d = model.get("data"); el.replaceChildren();
    const title = document.createElement("div"); title.style.fontWeight = "bold";
    title.textContent = d.title; el.appendChild(title);
    const vals = d.rows.flat().filter((v) => v !== null);
    const lo = Math.min(...vals), hi = Math.max(...vals);
    if (lo < 0 || d.note) {
      const key = document.createElement("small");
      key.textContent = (lo < 0 ? "__KEY__" : "") + (d.note ? (lo < 0 ? "; " : "") + d.note : "");
      el.appendChild(key);
    }
    const t = document.createElement("table"); t.style.borderCollapse = "collapse"; t.style.fontSize = "9px";
    const hr = document.createElement("tr"); hr.appendChild(document.createElement("th"));
    for (const c of d.cols) {
      const th = document.createElement("th"); th.textContent = c; hr.appendChild(th);
    }
    t.appendChild(hr);
    d.rows.forEach((row, i) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th"); th.textContent = d.row_labels[i]; tr.appendChild(th);
      row.forEach((v, j) => {
        const td = document.createElement("td");
        td.style.background = colour(v, lo, hi); td.style.minWidth = "14px"; td.style.height = "14px";
        td.title = d.row_labels[i] + " / " + d.cols[j] + ": " + (v === null ? "n/a" : v.toFixed(4));
        td.style.cursor = "pointer";
        td.addEventListener("click", () => { model.set("selected", [i, j]); model.save_changes(); });
        tr.appendChild(td);
      });
      t.appendChild(tr);
    });
    el.appendChild(t);
    const sel = document.createElement("div"); const s = model.get("selected");
    sel.textContent = s.length ? "selected: " + d.row_labels[s[0]] + " / " + d.cols[s[1]] : "click a cell";
    el.appendChild(sel);
  };
  draw();
  model.on("change:data", draw); model.on("change:selected", draw);
}
export default { render };
""".replace("__DIVERGING__", json.dumps(DIVERGING)).replace("__KEY__", SIGNED_KEY)

_PANEL_ESM = """
function render({ model, el }) {
  const box = document.createElement("textarea"); box.style.width = "100%"; box.rows = 3;
  box.value = model.get("prompt");
  const btn = document.createElement("button"); btn.textContent = "Generate";
  const status = document.createElement("div");
  const outs = document.createElement("div"); outs.style.display = "flex"; outs.style.gap = "1em";
  const pre = (label) => {
    const col = document.createElement("div"); col.style.flex = "1";
    const h = document.createElement("b"); h.textContent = label; col.appendChild(h);
    const p = document.createElement("pre"); p.style.whiteSpace = "pre-wrap"; p.style.background = "#f5f5f5";
    col.appendChild(p); outs.appendChild(col); return p;
  };
  const plain = pre("Unsteered"), steered = pre("Steered (" + model.get("method") + ")");
  const draw = () => {
    plain.textContent = model.get("plain"); steered.textContent = model.get("steered");
    status.textContent = model.get("status");
  };
  btn.addEventListener("click", () => {
    model.set("prompt", box.value); model.save_changes(); model.send({ type: "generate" });
  });
  el.append(box, btn, status, outs); draw();
  model.on("change:plain", draw); model.on("change:steered", draw); model.on("change:status", draw);
}
export default { render };
"""


def _widget_classes():
    import anywidget
    import traitlets

    class _Static(anywidget.AnyWidget):
        def static_html(self) -> str:  # pragma: no cover - overridden
            raise NotImplementedError

        def _repr_mimebundle_(self, **kwargs: Any):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data = dict(data or {})
            data["text/html"] = self.static_html()  # shown where no widget front end runs
            return (data, bundle[1]) if isinstance(bundle, tuple) else data

    class GridWidget(_Static):
        """A `[rows, cols]` grid; a click sets `selected = [row, col]`."""

        _esm = _GRID_ESM
        data = traitlets.Dict().tag(sync=True)
        selected = traitlets.List([]).tag(sync=True)

        def static_html(self) -> str:
            d = self.data
            return _grid_html(d["title"], d["rows"], d["row_labels"], d["cols"], d.get("note"))

    class SteeringPanel(_Static):
        """Prompt box + Generate: unsteered and steered continuations side by side."""

        _esm = _PANEL_ESM
        prompt = traitlets.Unicode("").tag(sync=True)
        method = traitlets.Unicode("PASTA").tag(sync=True)
        plain = traitlets.Unicode("").tag(sync=True)
        steered = traitlets.Unicode("").tag(sync=True)
        status = traitlets.Unicode("").tag(sync=True)

        def __init__(self, runner, **kwargs: Any):
            super().__init__(**kwargs)
            self._runner = runner
            self.on_msg(self._on_msg)

        def _on_msg(self, _widget, content, _buffers) -> None:
            if isinstance(content, dict) and content.get("type") == "generate":
                try:
                    self.run()
                except ValueError as exc:  # one line in the panel; the kernel stays fine
                    self.status = " ".join(str(exc).split())

        def run(self, prompt: str | None = None) -> "SteeringPanel":
            """Generate for `prompt` (default the panel's); fills `.plain` and `.steered`."""
            if prompt is not None:
                self.prompt = prompt
            self.status = "generating ..."
            self.plain, self.steered = self._runner(self.prompt)
            self.status = ""
            return self

        def static_html(self) -> str:
            e = html.escape
            return (
                f'<div class="headsteer-view"><b>Prompt</b><pre>{e(self.prompt)}</pre>'
                f'<div style="display:flex;gap:1em"><div style="flex:1"><b>Unsteered</b>'
                f'<pre>{e(self.plain)}</pre></div><div style="flex:1"><b>Steered ({e(self.method)})</b>'
                f"<pre>{e(self.steered)}</pre></div></div></div>"
            )

    return GridWidget, SteeringPanel


def _grid(data: dict):
    if widgets_available():
        grid_cls, _ = _widget_classes()
        return grid_cls(data=data)
    return StaticView(
        _grid_html(data["title"], data["rows"], data["row_labels"], data["cols"], data.get("note"))
    )


def scores_widget(scores, *, title: str | None = None):
    """`HeadScores` as a clickable `[n_layers, n_heads]` grid (`.selected` = `[layer, head]`)."""
    from heads.results.scores import HeadScores

    if not isinstance(scores, HeadScores):
        from heads.errors import HeadsteerTypeError

        raise HeadsteerTypeError(f"scores must be HeadScores, got {type(scores).__name__}")
    s = scores.scores.float()
    data = {
        "title": title or f"{scores.method} per head",
        "rows": _clean(s.tolist()),
        "row_labels": [f"L{i}" for i in range(s.shape[0])],
        "cols": [f"H{j}" for j in range(s.shape[1])],
    }
    note = sign_note(scores)
    if note:
        data["note"] = note
    return _grid(data)


def pattern_widget(model, prompt: str, layer: int, head: int):
    """One head's `[T, T]` attention pattern on `prompt` (`head_pattern`), token labels on both axes.

    Raises:
        ValueError: a bad layer / head / prompt (from `head_pattern`).
    """
    from heads.scorers.attention_mass import head_pattern

    probs, tokens, _ = head_pattern(model, prompt, layer, head)
    labels = [f"{i}:{t}" for i, t in enumerate(tokens)]
    data = {
        "title": f"layer {layer}, head {head} attention (rows: queries, columns: keys)",
        "rows": _clean(probs.float().tolist()),
        "row_labels": labels,
        "cols": labels,
    }
    return _grid(data)


def steering_panel(model, prompt: str, heads: dict[int, list[int]] | None = None, *, alpha: float = 0.01,
                   steer: list | None = None, max_new_tokens: int = 24, run: bool = False):  # fmt: skip
    """A prompt box and a Generate button: greedy unsteered and steered continuations.

    Args:
        prompt: the starting prompt (`**...**` marks the span).
        heads: PASTA heads `{layer: [head, ...]}`; alpha: PASTA's alpha (default 0.01).
        steer: instead of `heads` / `alpha`, any list of interventions
            (`[Spotlight(tau=0.3)]`, `[Act(), Pasta(...)]`, ...), as `SteeredModel.generate` takes.
        max_new_tokens: tokens per continuation (default 24).
        run: generate once now (default False), e.g. so a headless run shows the texts.

    Raises:
        ValueError: bad heads / alpha (from `Pasta`), both or neither of `heads` and `steer`,
            an empty `steer`; before any generation.
    """
    from steer.pasta.method import Pasta
    from steer.steered_model import SteeredModel

    if (heads is None) == (steer is None):
        raise HeadsteerValueError(
            "steering_panel needs heads (PASTA) or steer (a list of interventions), not both"
        )
    if steer is not None and (not isinstance(steer, list) or not steer):
        raise HeadsteerValueError(f"steer must be a non-empty list of interventions, got {short_repr(steer)}")
    steer = list(steer) if steer is not None else [Pasta(heads=heads, alpha=alpha)]  # type: ignore[arg-type]
    method = " + ".join(type(s).__name__ for s in steer)
    sm = SteeredModel(model)

    def runner(text: str) -> tuple[str, str]:
        plain = sm.generate(text, [], max_new_tokens=max_new_tokens, progress=False).text
        steered = sm.generate(text, steer, max_new_tokens=max_new_tokens, progress=False).text
        return plain, steered

    if widgets_available():
        _, panel_cls = _widget_classes()
        panel = panel_cls(runner, prompt=prompt, method=method)
        return panel.run() if run else panel
    plain, steered = runner(prompt) if run else ("", "")
    e = html.escape
    return StaticView(
        f'<div class="headsteer-view"><b>Prompt</b><pre>{e(prompt)}</pre>'
        f'<div style="display:flex;gap:1em"><div style="flex:1"><b>Unsteered</b><pre>{e(plain)}</pre></div>'
        f'<div style="flex:1"><b>Steered ({e(method)})</b><pre>{e(steered)}</pre></div></div></div>'
    )

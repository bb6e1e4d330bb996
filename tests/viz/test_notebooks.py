"""Every notebook in notebooks/ runs top to bottom without error, and its figures survive export
(`jupyter nbconvert --to html`: each plotly figure as HTML, plotly.js inlined once).

Each executed notebook is kept in `.cache/notebooks/` (ignored by git): `make docs` renders it
into the site with its outputs (docs/scripts/gen_pages.py).

The suite runs them with `HEADSTEER_NOTEBOOK_SIZE=small`: a notebook whose work is long reads it
in its first cell and uses smaller inputs (fewer generated tokens, prompts or pairs; the same
cells run); unset, a user gets the full sizes."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = ROOT / ".cache" / "notebooks"


def keep_executed(nb: nbformat.NotebookNode, name: str) -> Path:
    """Write the executed notebook to `.cache/notebooks/name` (atomically) for the docs site."""
    EXECUTED.mkdir(parents=True, exist_ok=True)
    out = EXECUTED / name
    tmp = out.with_name(f".{name}.{os.getpid()}.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, out)
    return out


pytestmark = pytest.mark.real


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTEER_NOTEBOOK_SIZE", "small")  # the kernel inherits the environment
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures, "every notebook shows at least one plotly figure"
    # the executed notebook exported as nbconvert does it (no second execution): every figure is
    # there as a plotly div drawn by the inlined plotly.js, not a mimetype HTML cannot show
    assert all("text/html" in o["data"] for o in figures), "a figure without an HTML form"
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert html.count('class="plotly-graph-div"') >= len(figures)
    assert html.count("Plotly.newPlot(") >= len(figures)
    assert "plotly.js v" in html and len(html) < 12_000_000  # plotly.js inlined once (~4.8 MB)
    kept = keep_executed(nb, path.name)
    assert nbformat.read(kept, as_version=4).cells == nb.cells
    if path.name.startswith("01_"):
        assert "baseline:" in text and "PASTA   :" in text
    if path.name.startswith("02_"):
        assert "implements" in text or "strongest" in text  # the describe() line
    if path.name.startswith("03_"):
        assert "SpotLight:" in text and "mean share on the first token" in text
    if path.name.startswith("05_"):
        assert "largest difference across backends" in text and "max |TL hook + PASTA" in text
    if path.name.startswith("10_"):
        assert "static fallback has both texts: True" in text and "live widgets: True" in text

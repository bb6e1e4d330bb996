"""Every notebook in notebooks/ runs top to bottom without error."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.real


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures, "every notebook shows at least one plotly figure"
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

"""What headsteer writes for the user: escaped figure text, formula-free CSV, no silent overwrite."""

import pandas as pd
import pytest
import torch

from heads import HeadScores
from viz.figures import attention_pattern, head_heatmap, mapped_pairs, score_distribution
from viz.reports.base import Report
from viz.tables import neutralise_cell, write_csv

LINK = "<a href='https://evil.example'>click</a>"


def _texts(fig) -> list[str]:
    """Every string plotly would render as (pseudo-)HTML: titles, tick labels, bar text, names."""
    out = [fig.layout.title.text or ""]
    for trace in fig.data:
        for attr in ("x", "y", "text", "name"):
            value = getattr(trace, attr, None)
            if isinstance(value, str):
                out.append(value)
            elif value is not None:
                out += [v for v in value if isinstance(v, str)]
    return out


def test_user_strings_in_figures_are_escaped():
    s = HeadScores(torch.rand(2, 3), method=f"<b>{LINK}</b>", model=LINK)
    figs = [
        head_heatmap(s),
        score_distribution(s),
        head_heatmap(s, title=f"MAPS relation score: {LINK}"),  # relation names reach titles
        attention_pattern(torch.eye(2), ["<b>tok</b>", LINK], title=LINK),
    ]
    salient = pd.DataFrame({"source": ["<b>x</b>"], "targets": [[LINK]], "sigma": [1.0]})
    figs.append(mapped_pairs(salient, title=LINK))
    for fig in figs:
        texts = _texts(fig)
        assert not any("<a" in t or "<b>" in t for t in texts), texts
    assert head_heatmap(s).layout.title.text == (
        "&lt;b&gt;&lt;a href='https://evil.example'&gt;click&lt;/a&gt;&lt;/b&gt; — "
        "&lt;a href='https://evil.example'&gt;click&lt;/a&gt;"
    )
    assert list(figs[3].data[0].x) == [
        "0:&lt;b&gt;tok&lt;/b&gt;",
        "1:" + LINK.replace("<", "&lt;").replace(">", "&gt;").replace(" ", "\u2423"),  # visible space
    ]


@pytest.mark.parametrize(
    "cell, want",
    [
        ('=HYPERLINK("http://x")', '\'=HYPERLINK("http://x")'),
        ("+1+1", "'+1+1"),
        ("-2+3", "'-2+3"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("\t=1", "'\t=1"),
        ("plain", "plain"),
        (-3.5, -3.5),
        ("", ""),
    ],
)
def test_neutralise_cell(cell, want):
    assert neutralise_cell(cell) == want


def test_write_csv_neutralises_and_refuses_overwrite(tmp_path):
    frame = pd.DataFrame({"output": ["=1+1", "fine", "@cmd"], "score": [-1.5, 2.0, 0.0], "=col": [1, 2, 3]})
    p = write_csv(tmp_path / "sub" / "t.csv", frame)
    back = pd.read_csv(p, keep_default_na=False)
    assert list(back.columns) == ["output", "score", "'=col"]
    assert back["output"].tolist() == ["'=1+1", "fine", "'@cmd"]
    assert back["score"].tolist() == [-1.5, 2.0, 0.0]  # numbers stay numbers
    assert frame["output"].tolist()[0] == "=1+1"  # the caller's frame is not changed
    with pytest.raises(ValueError, match="exists"):
        write_csv(p, frame.head(1))
    assert len(pd.read_csv(p)) == 3
    write_csv(p, frame.head(1), overwrite=True)
    assert len(pd.read_csv(p)) == 1


def test_report_and_attention_report_refuse_overwrite(tmp_path, tiny_llama, monkeypatch):
    import viz.cli.jobs

    p = Report("t", LINK).save(tmp_path / "new" / "r.html")
    assert "&lt;a href=" in p.read_text() and LINK not in p.read_text()
    with pytest.raises(ValueError, match="exists"):
        Report("t", "m").save(p)
    out = tmp_path / "att.html"
    html, csv, _ = viz.cli.jobs.attention_report(tiny_llama, "Read **this** now.", out, top_k=2)
    assert html.is_file() and csv.is_file()
    monkeypatch.setattr(viz.cli.jobs, "span_attention", lambda *a, **k: pytest.fail("computed first"))
    out.unlink()
    with pytest.raises(ValueError, match="att.csv exists"):
        viz.cli.jobs.attention_report(tiny_llama, "Read **this** now.", out, top_k=2)

"""Pages generated at build time by mkdocs-gen-files (run by `make docs`), so they cannot drift.

(`families.md` is committed: `docs/scripts/gen_families.py` writes it and a test checks it.)

* `shapes.md`: the shape-letter glossary, from the `heads` package docstring;
* `reference/`: one API page per package and subpackage of heads, steer, probes and viz,
  rendered by mkdocstrings from the docstrings, with its `SUMMARY.md` for literate-nav;
* `api.md`: the public API, one line per name each package exports (`__all__`);
* `notebooks/`: every notebook of `notebooks/` as a page, with the outputs of its last run by
  the test suite (`tests/viz/test_notebooks.py` keeps each executed copy in
  `.cache/notebooks/`; a copy whose code differs from the notebook is stale and not used), and
  plotly.js once for all of them (`assets/plotly.min.js`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PACKAGES = ("heads", "steer", "probes", "viz")


# ------------------------------------------------------------------------- shape letters
def _shapes_page() -> str:
    doc = ast.get_docstring(ast.parse((ROOT / "heads" / "__init__.py").read_text())) or ""
    m = re.search(r"Shape letters in docstrings.*?(?:\n\n|\Z)", doc, re.S)
    if not m:
        raise RuntimeError("heads/__init__.py's docstring has no 'Shape letters in docstrings' paragraph")
    para = " ".join(m.group(0).split())
    body = para.split("): ", 1)[1] if "): " in para else para.split(":", 1)[-1]
    # "... B batch rows; N rows of ...; ... M head variants (`...`). A head selection ..."
    main, _, tail = body.partition(". A head selection")
    items = [x.strip() for x in main.split(";") if x.strip()]
    rows = []
    for item in items:
        # "Q query positions and K key positions of one attention call" holds two letters
        parts = re.split(r"\s+and\s+(?=[A-Za-z]\s)", item)
        if len(parts) > 1 and " of " in parts[-1]:  # "... of one attention call" is shared
            shared = parts[-1][parts[-1].index(" of ") :]
            parts = [p if " of " in p else p + shared for p in parts]
        for part in parts:
            letter, _, meaning = part.strip().partition(" ")
            rows.append(f"| `{letter}` | {meaning.strip().rstrip('.')} |")
    return "\n".join(
        [
            "# Shape letters",
            "",
            "Every docstring writes tensor shapes with these letters (`[B, T]`: a batch of token",
            "rows). Generated from the `heads` package docstring.",
            "",
            "| letter | meaning |",
            "|---|---|",
            *rows,
            "",
            ("A head selection" + tail).rstrip(". ") + "." if tail else "",
            "",
            "The original paragraph:",
            "",
            f"> {para}",
            "",
        ]
    )


# ------------------------------------------------------------------------- API reference
def _public(path: Path) -> bool:
    return not any(part.startswith("_") and part != "__init__.py" for part in path.parts)


def _exports_nothing(path: Path) -> bool:
    """Whether the module at `path` sets `__all__` to an empty list: an internal module, whose
    page shows its docstring only (mkdocstrings reads an empty `__all__` as no `__all__`)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "__all__":
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            return isinstance(value, (ast.List, ast.Tuple)) and not value.elts
    return False


def _reference() -> None:
    nav = mkdocs_gen_files.Nav()
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            rel = init.relative_to(ROOT)
            if not _public(rel) or "data" in rel.parts:
                continue
            parts = rel.parent.parts
            dotted = ".".join(parts)
            modules = sorted(
                p
                for p in init.parent.glob("*.py")
                if p.name != "__init__.py" and not p.name.startswith("_") and p.name != "__main__.py"
            )
            if len(parts) == 1:
                doc_path = Path("reference", pkg, "index.md")
            else:
                doc_path = Path("reference", pkg, dotted + ".md")
            nav[(pkg, dotted)] = doc_path.relative_to("reference").as_posix()
            with mkdocs_gen_files.open(doc_path, "w") as fh:
                fh.write(f"# `{dotted}`\n\n")
                fh.write(
                    f"::: {dotted}\n    options:\n      show_root_heading: false\n      members: false\n\n"
                )
                for mod in modules:
                    if _exports_nothing(mod):  # internal: the docstring, no members
                        fh.write(f"::: {dotted}.{mod.stem}\n    options:\n      members: false\n\n")
                    else:
                        fh.write(f"::: {dotted}.{mod.stem}\n\n")
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as fh:
        fh.writelines(nav.build_literate_nav())


# ------------------------------------------------------------------------- public API
def _first_line(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    line = doc.strip().split("\n\n", 1)[0].replace("\n", " ")
    return line.replace("|", "\\|")


def _api_page() -> str:
    lines = [
        "# Public API",
        "",
        "Every name the four packages export (their `__all__`), with the first line of its",
        "docstring; the [API reference](reference/heads/index.md) has the whole docstrings.",
        "Generated from the code at build time.",
        "",
    ]
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names = list(getattr(mod, "__all__", []))
        if not names:
            continue
        lines += [f"## `{pkg}`", ""]
        groups: dict[str, list[str]] = {}
        for name in names:
            if not name.startswith("__"):
                groups.setdefault(_group(pkg, getattr(mod, name)), []).append(name)
        for title in GROUPS:
            if title not in groups:
                continue
            if len(groups) > 1:
                lines += [f"### {title}", ""]
            lines += ["| name | what it is |", "|---|---|"]
            for name in groups[title]:
                obj = getattr(mod, name)
                kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
                lines.append(f"| `{pkg}.{name}` ({kind}) | {_first_line(obj)} |")
            lines.append("")
    return "\n".join(lines)


GROUPS = ("Analyses", "Requests", "Results", "Everything else")
"""The sections of `heads`' public API (the other packages are one section each)."""


def _group(pkg: str, obj: object) -> str:
    """Which section of the API page a name of `pkg` goes in: `heads`' analyses (functions of
    `heads.scorers`, and `heads.run`), their requests (`Request` classes), their results (classes
    with a result `SCHEMA`, and the `Result` protocol), everything else."""
    if pkg != "heads":
        return "Everything else"
    from heads.scorers.request_base import Request

    where = getattr(obj, "__module__", "") or ""
    if inspect.isclass(obj) and issubclass(obj, Request):
        return "Requests"
    if inspect.isclass(obj) and (
        hasattr(obj, "SCHEMA") or obj.__name__ == "Result" or where.startswith("heads.results")
    ):
        return "Results"
    if inspect.isfunction(obj) and where.startswith("heads.scorers."):
        return "Analyses"
    return "Everything else"


# ------------------------------------------------------------------------- notebooks
EXECUTED = ROOT / ".cache" / "notebooks"
PLOTLY_INIT = "plotly.js v"  # the text/html output that carries the whole plotly.js
CDN_SCRIPT = re.compile(r'<script src="https?://[^"]*"></script>')


def _code(nb: Any) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _notebook_page(path: Path) -> str:
    import nbformat
    from nbconvert import MarkdownExporter

    nb = nbformat.read(path, as_version=4)
    ran = EXECUTED / path.name
    executed = ran.is_file() and _code(nbformat.read(ran, as_version=4)) == _code(nb)
    if executed:
        nb = nbformat.read(ran, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if out.get("name") == "stderr" and "it/s]" in out.get("text", ""):
                continue  # a progress bar's last frame (loading weights)
            html = out.get("data", {}).get("text/html")
            if html is not None:
                if PLOTLY_INIT in html:
                    continue  # plotly.js comes once, from assets/
                # no network: drop script tags that fetch from the web (MathJax)
                out["data"]["text/html"] = CDN_SCRIPT.sub("", html).strip()
            kept.append(out)
        cell["outputs"] = kept
    body, _ = MarkdownExporter().from_notebook_node(nb)
    src = f"notebooks/{path.name}"
    note = (
        f"*The notebook `{src}`, as the test suite last ran it "
        "(`HEADSTEER_NOTEBOOK_SIZE=small`: smaller inputs where a step is long).*"
        if executed
        else f"*The notebook `{src}` without outputs: run `make test` before `make docs` to include "
        "the outputs of its run.*"
    )
    return f'<script src="../assets/plotly.min.js"></script>\n\n{note}\n\n{body}'


def _notebooks() -> None:
    import plotly.offline

    with mkdocs_gen_files.open("assets/plotly.min.js", "w") as fh:
        fh.write(plotly.offline.get_plotlyjs())
    nav = mkdocs_gen_files.Nav()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        name = f"{path.stem}.md"
        title = path.stem.split("_", 1)[-1].replace("_", " ")
        nav[title[0].upper() + title[1:]] = name
        with mkdocs_gen_files.open(f"notebooks/{name}", "w") as fh:
            fh.write(_notebook_page(path))
    with mkdocs_gen_files.open("notebooks/SUMMARY.md", "w") as fh:
        fh.writelines(nav.build_literate_nav())


with mkdocs_gen_files.open("shapes.md", "w") as fh:
    fh.write(_shapes_page())
with mkdocs_gen_files.open("api.md", "w") as fh:
    fh.write(_api_page())
_reference()
_notebooks()

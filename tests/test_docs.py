"""Docs hygiene: code and notebooks cite only files in the repository; README imports resolve.

A docstring or comment that points a reader to a Markdown file (`docs/methods/pasta.md`) must
name a file that exists in this repository: notes kept outside it (a design document, method
notes in a sibling folder) cannot be read by a user.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("heads", "steer", "probes", "viz", "tests", "benchmarks", "notebooks")

# A path-like token ending in .md: `docs/methods/pasta.md`, `../x/y.md`, `DESIGN.md`.
MD_REF = re.compile(r"(?<![\w./-])((?:\.\.?/)?[\w.-]+(?:/[\w.-]+)*\.md)\b")
# Notes that live outside the repository, however they are cited.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", r"\bshared/" + "methods", "design" + r"\s+notes"]), re.I)


def _texts() -> list[tuple[Path, int, str]]:
    """(file, line number, line) for every line of source, and of notebook cells, in FOLDERS."""
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix == ".py" and path != Path(__file__).resolve():
                lines = path.read_text(encoding="utf-8").splitlines()
            elif path.suffix == ".ipynb" and ".ipynb_checkpoints" not in path.parts:
                cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
                lines = [ln for c in cells for ln in "".join(c["source"]).splitlines()]
            else:
                continue
            out.extend((path, i, ln) for i, ln in enumerate(lines, 1))
    return out


def _resolves(ref: str, source: Path) -> bool:
    return (ROOT / ref).is_file() or (source.parent / ref).is_file()


def test_cited_markdown_files_exist():
    bad = [
        f"{p.relative_to(ROOT)}:{i}: {ref}"
        for p, i, line in _texts()
        for ref in MD_REF.findall(line)
        if not _resolves(ref, p)
    ]
    assert not bad, "cites files that are not in the repository:\n" + "\n".join(bad)


def test_no_citation_of_notes_outside_the_repository():
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p, i, line in _texts() if OUTSIDE.search(line)]
    assert not bad, "cites notes outside the repository:\n" + "\n".join(bad)


def test_the_checks_catch_planted_citations(tmp_path):
    """The two rules fail on the citations they exist for, and pass real pages."""
    src = tmp_path / "mod.py"
    assert not _resolves("DESIGN.md", src)
    assert not _resolves("methods/pasta.md", src)
    assert MD_REF.findall("(methods/pasta.md §2; DESIGN.md)") == ["methods/pasta.md", "DESIGN.md"]
    assert OUTSIDE.search("see ../" + "shared/methods")
    assert _resolves("docs/methods/pasta.md", src)
    assert _resolves("README.md", src)


def _readme_imports() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python snippet"
    pairs = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module:
                pairs += [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                pairs += [(a.name, "") for a in node.names]
    return pairs


def test_readme_snippets_use_current_import_paths():
    """Every name the README imports exists, and none comes through a deprecated alias."""
    ours = ("heads", "steer", "probes", "viz")
    for module, name in _readme_imports():
        if module.split(".")[0] not in ours:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            mod = importlib.import_module(module)
            if name:
                assert hasattr(mod, name), f"README: from {module} import {name}: no such name"


@pytest.mark.parametrize("page", ["index.md", "getting-started.md", "methods/pasta.md", "benchmarks.md"])
def test_docs_pages_exist(page):
    assert (ROOT / "docs" / page).is_file()


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_docs_name_existing_repository_paths():
    """A backticked path into the repository (`tests/heads/test_fused.py`) exists."""
    tops = "|".join(FOLDERS + ("docs",))
    path_ref = re.compile(rf"`((?:{tops})/[\w./-]*[\w/])`")
    bad = [
        f"{page.relative_to(ROOT)}: {ref}"
        for page in _doc_pages()
        for ref in path_ref.findall(page.read_text(encoding="utf-8"))
        if "*" not in ref and not (ROOT / ref).exists()
    ]
    assert not bad, "docs name paths that do not exist:\n" + "\n".join(bad)


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_docs_name_existing_modules_and_objects():
    """A backticked dotted name (`heads.engine.kernels.fused.warm_up`) imports, with no deprecated alias."""
    dotted_ref = re.compile(r"`((?:heads|steer|probes|viz)(?:\.[A-Za-z_]\w*)+)`")
    bad = []
    for page in _doc_pages():
        for ref in sorted(set(dotted_ref.findall(page.read_text(encoding="utf-8")))):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)
                    _resolve(ref)
            except (ImportError, AttributeError, DeprecationWarning) as exc:
                bad.append(f"{page.relative_to(ROOT)}: {ref} ({type(exc).__name__})")
    assert not bad, "docs name modules or objects that do not exist:\n" + "\n".join(bad)


def test_generated_pages_never_shadow_committed_ones():
    """A page `docs/scripts/gen_pages.py` writes at build time replaces a committed page of the
    same name in the site: none of its literal page names, nor its `reference/` folder, may
    exist under docs/ (families.md once did, and the site showed a stale table)."""
    import re

    root = Path(__file__).resolve().parents[1]
    script = (root / "docs" / "scripts" / "gen_pages.py").read_text()
    names = re.findall(r'mkdocs_gen_files\.open\("([^"]+)"', script)
    assert "shapes.md" in names and "families.md" not in names
    for name in names:
        assert not (root / "docs" / name).exists(), name
    assert not (root / "docs" / "reference").exists()


def test_every_scorer_subpackage_is_in_the_architecture_page():
    """docs/architecture.md lists every subpackage of `heads/scorers/` (its inventory went stale
    once: patching, circuits and roles were missing)."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    subpackages = sorted(p.parent.name for p in (ROOT / "heads" / "scorers").glob("*/__init__.py"))
    assert subpackages
    missing = [name for name in subpackages if f"`scorers/{name}/`" not in page]
    assert not missing, f"docs/architecture.md does not list heads/scorers/ subpackages {missing}"
